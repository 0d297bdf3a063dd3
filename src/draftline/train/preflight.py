"""Checks before launch: everything a rank would otherwise discover after start-up, found in the launching
process in seconds, with no tensor loaded.

The drafter the spec describes is built on the meta device (shapes, no memory); the parent's keys and shapes
come from its safetensors headers; the vocabulary, the data manifest and the verifier's config are compared
with them. Each problem raises one :class:`DraftlineError` naming the thing, the shapes and the fix.
"""

from __future__ import annotations

import time

import torch

from draftline.errors import CheckpointError, DataError


def drafter_shapes(verifier: str, layer: dict, *, aux_layer_ids: list[int], draft_vocab_size: int) -> dict[str, tuple[int, ...]]:
    """``{key: shape}`` of the drafter ``build_draft_model`` builds for the spec, built on the meta device
    (no weight is allocated, the verifier's embeddings are not read)."""
    from speculators.models.eagle3 import Eagle3DraftModel

    from draftline.drafter.checkpoints import model_shapes
    from draftline.drafter.shape import verifier_config

    config = verifier_config(verifier, draft_vocab_size=draft_vocab_size, aux_layer_ids=aux_layer_ids, layer=layer)
    config.transformer_layer_config._attn_implementation = "sdpa"  # noqa: SLF001 (as the ranks build it)
    with torch.device("meta"):
        model = Eagle3DraftModel(config)
    return model_shapes(model)


def check_verifier(verifier: str, layer: dict, manifest: dict) -> None:
    """The verifier's config against the drafter's layer and the data (speculators refuses a hidden-size
    mismatch only inside the ranks, after loading the embeddings)."""
    from transformers import AutoConfig

    vc = AutoConfig.from_pretrained(verifier)
    vc = getattr(vc, "text_config", vc)
    if vc.hidden_size != layer["hidden_size"]:
        raise CheckpointError(f"the drafter's layer has hidden size {layer['hidden_size']} but the verifier "
                              f"{verifier} has {vc.hidden_size}: choose a parent made for this verifier")
    if vc.vocab_size != manifest["vocab_size"] or vc.hidden_size != manifest["hidden_size"]:
        raise DataError(f"the data was prepared with hidden size {manifest['hidden_size']} and vocabulary "
                        f"{manifest['vocab_size']}, but the verifier {verifier} has {vc.hidden_size} and "
                        f"{vc.vocab_size}: prepare the data with this verifier")


def check_data(shapes: dict[str, tuple[int, ...]], manifest: dict, aux_layer_ids: list[int]) -> None:
    """The data's hidden states against the drafter's input projection: ``fc`` reads aux x hidden."""
    aux = manifest["aux_layer_ids"]
    if list(aux) != list(aux_layer_ids):
        raise DataError(f"the data has aux layers {aux} but the drafter reads {aux_layer_ids}: prepare the data "
                        f"with --aux-layers {','.join(map(str, aux_layer_ids))}")
    want = len(aux) * manifest["hidden_size"]
    fc = shapes.get("fc.weight")
    if fc is not None and fc[1] != want:
        raise DataError(f"fc.weight: the drafter reads {fc[1]} features per token, but the data's hidden states "
                        f"have {len(aux)} x {manifest['hidden_size']} = {want}: prepare the data with the "
                        "verifier the drafter is for")


def check_vocab(vocab: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]], verifier_vocab: int) -> None:
    d2t, t2d = vocab["d2t"], vocab["t2d"]
    if tuple(d2t.shape) != shapes.get("d2t", tuple(d2t.shape)) or t2d.numel() != verifier_vocab:
        raise DataError(f"the draft vocabulary (d2t [{d2t.numel()}], t2d [{t2d.numel()}]) does not fit the drafter "
                        f"(d2t {list(shapes.get('d2t', ()))}, verifier vocabulary {verifier_vocab})")
    targets = torch.arange(d2t.numel()) + d2t
    if int(targets.min()) < 0 or int(targets.max()) >= verifier_vocab or not bool(t2d[targets].all()):
        raise DataError("d2t names target tokens t2d does not mark (or outside the verifier's vocabulary): the "
                        "draft vocabulary is corrupt; rebuild it (vocab=rebuild)")


def check_parent(files, shapes: dict[str, tuple[int, ...]], *, rebuild: bool, header: dict | None = None) -> None:
    """The parent's keys and shapes (headers only), after the ``midlayer.`` -> ``layers.0.`` remap, against
    the drafter; under vocab=rebuild ``lm_head``'s rows are those of the parent's own ``d2t``."""
    from draftline.drafter.checkpoints import match_keys, read_header

    header = header if header is not None else read_header(files)
    match_keys(header, shapes, root=files.root, rebuild=rebuild)
    if rebuild:
        rows = dict(header).get("lm_head.weight", ((0,), ""))[0][0]
        n = dict(header).get("d2t", ((rows,), ""))[0][0]
        if rows != n:
            raise CheckpointError(f"parent {files.root}: lm_head.weight has {rows} rows but d2t {n}: the parent's "
                                  "head is not in its own draft vocabulary's order; it cannot be remapped")


def preflight(*, verifier: str, layer: dict, manifest: dict, vocab: dict[str, torch.Tensor],
              parent_files=None, header: dict | None = None, vocab_policy: str = "parent") -> dict[str, float]:
    """Every check before launch; returns ``{"seconds": ...}``. Raises the first problem found."""
    t0 = time.perf_counter()
    from draftline.drafter.shape import aux_layer_ids

    aux = (aux_layer_ids(parent_files.config) if parent_files is not None else None) or manifest["aux_layer_ids"]
    check_verifier(verifier, layer, manifest)
    shapes = drafter_shapes(verifier, layer, aux_layer_ids=aux, draft_vocab_size=int(vocab["d2t"].numel()))
    check_data(shapes, manifest, aux)
    check_vocab(vocab, shapes, manifest["vocab_size"])
    if parent_files is not None:
        check_parent(parent_files, shapes, rebuild=vocab_policy == "rebuild", header=header)
    return {"seconds": time.perf_counter() - t0}

