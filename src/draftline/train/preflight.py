"""Checks before launch: everything a rank would otherwise discover after start-up, found in the launching
process in seconds, with no tensor loaded.

The drafter the spec describes is built on the meta device (shapes, no memory); the parent's keys and shapes
come from its safetensors headers; the vocabulary, the data manifest and the verifier's config are compared
with them. Each problem raises one :class:`DraftlineError` naming the thing, the shapes and the fix.
"""

from __future__ import annotations

import copy
import time
import traceback

import torch
from pydantic import ValidationError

from draftline.drafter.checkpoints import match_keys, model_shapes, read_header
from draftline.drafter.model import meta_drafter
from draftline.drafter.shape import aux_layer_ids as aux_of
from draftline.drafter.shape import require_aux_layers, verifier_config
from draftline.errors import CheckpointError, ConfigError, DataError, ParentMismatch
from draftline.serving import hf_model


def drafter_shapes(verifier: str, layer: dict, *, aux_layer_ids: list[int], draft_vocab_size: int) -> dict[str, tuple[int, ...]]:
    """``{key: shape}`` of the drafter ``build_draft_model`` builds for the spec, built on the meta device
    (no weight is allocated, the verifier's embeddings are not read)."""
    config = verifier_config(verifier, draft_vocab_size=draft_vocab_size, aux_layer_ids=aux_layer_ids, layer=layer)
    return model_shapes(meta_drafter(config))


def check_verifier(verifier: str, layer: dict, manifest: dict) -> None:
    """The verifier's config against the drafter's layer and the data (speculators refuses a hidden-size
    mismatch only inside the ranks, after loading the embeddings)."""
    vc = hf_model.load_text_config(verifier)
    if vc.hidden_size != layer["hidden_size"]:
        raise ParentMismatch(f"the parent's layer has hidden size {layer['hidden_size']} but the verifier "
                             f"{verifier} has {vc.hidden_size}: choose a parent made for this verifier (or "
                             "init=random)")
    if vc.vocab_size != manifest["vocab_size"] or vc.hidden_size != manifest["hidden_size"]:
        raise DataError(f"the data was prepared with hidden size {manifest['hidden_size']} and vocabulary "
                        f"{manifest['vocab_size']}, but the verifier {verifier} has {vc.hidden_size} and "
                        f"{vc.vocab_size}: prepare the data with this verifier")


def check_data(shapes: dict[str, tuple[int, ...]], manifest: dict, aux_layer_ids: list[int],
               drafter: str = "the drafter") -> None:
    """The data's hidden states against the drafter's input projection: ``fc`` reads aux x hidden."""
    aux = manifest["aux_layer_ids"]
    require_aux_layers(drafter, aux_layer_ids, aux)
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
    header = header if header is not None else read_header(files)
    match_keys(header, shapes, root=files.root, rebuild=rebuild)
    if rebuild:
        rows = dict(header).get("lm_head.weight", ((0,), ""))[0][0]
        n = dict(header).get("d2t", ((rows,), ""))[0][0]
        if rows != n:
            raise CheckpointError(f"parent {files.root}: lm_head.weight has {rows} rows but d2t {n}: the parent's "
                                  "head is not in its own draft vocabulary's order; it cannot be remapped")


def check_parent_fits_data(name: str, header: dict, manifest: dict) -> None:
    """Refuse, before any rank starts, data prepared with a verifier of another shape than the parent's."""
    theirs = {}
    if "fc.weight" in header:
        theirs["hidden size"] = header["fc.weight"][0][0]
    if "t2d" in header:
        theirs["vocabulary"] = header["t2d"][0][0]
    ours = {"hidden size": manifest["hidden_size"], "vocabulary": manifest["vocab_size"]}
    wrong = [k for k in theirs if theirs[k] != ours[k]]
    if wrong:
        got = ", ".join(f"{k} {theirs[k]}" for k in wrong)
        want = ", ".join(f"{k} {ours[k]}" for k in wrong)
        raise ParentMismatch(f"parent {name} was trained for a verifier with {got}, but the data was prepared with "
                             f"{manifest.get('verifier_name') or manifest['verifier']} ({want}): choose a parent "
                             "made for this verifier, or prepare the data with the parent's verifier")


def check_parent_config_matches_weights(name: str, config: dict | None, header: dict) -> None:
    """Refuse a parent whose config.json describes another shape than its weights (the config of another
    checkpoint beside these weights would build a drafter the weights do not fit, or silently reshape it)."""
    layer = (config or {}).get("transformer_layer_config") or config or {}
    shape = {k: v[0] for k, v in header.items()}
    found = {"hidden size": shape.get("fc.weight", [None])[0]}
    for prefix in ("layers.0.", "midlayer."):
        if f"{prefix}mlp.gate_proj.weight" in shape:
            found["intermediate size"] = shape[f"{prefix}mlp.gate_proj.weight"][0]
    said = {"hidden size": layer.get("hidden_size"), "intermediate size": layer.get("intermediate_size")}
    wrong = [k for k, v in found.items() if v is not None and said.get(k) is not None and said[k] != v]
    if wrong:
        raise CheckpointError(f"parent {name}: its config.json says " + ", ".join(f"{k} {said[k]}" for k in wrong)
                              + " but its weights have " + ", ".join(f"{k} {found[k]}" for k in wrong)
                              + ": the config.json belongs to another checkpoint; put the weights' own config "
                              "beside them")


def check_inputs(cfg, data) -> None:
    """The finetune settings against the files they name and the data: before the run exists."""
    shortest = min(data.sample_lengths(), default=0)
    if cfg.tokens_per_batch < shortest:
        raise DataError(f"--tokens-per-batch {cfg.tokens_per_batch} is below the shortest sample of {cfg.data} "
                        f"({shortest} tokens): every batch would hold one sample over budget; pass "
                        f"--tokens-per-batch {shortest} or more")


def check_ds_config(conf: dict, path, world_size: int = 1) -> None:
    """The resolved DeepSpeed config through DeepSpeed's own ``DeepSpeedConfig``, built as ``deepspeed.initialize``
    builds it in every rank: a missing batch size, a value of the wrong type, an unknown ZeRO key, fp16 with
    bf16 are found here in seconds, before the run exists, instead of in every rank after start-up. Its rules
    are DeepSpeed's; only its message is made one line.

    Outside a process group (none is created here) DeepSpeed takes the world to be one process. The one setting
    it checks against the world size, ``train_batch_size``, is therefore left to the ranks in a run of more than
    one, when ``train_micro_batch_size_per_gpu`` is given (DeepSpeed then derives it)."""
    from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError  # noqa: PLC0415 (deepspeed: slow, and prints an accelerator warning at import)

    checked = copy.deepcopy(conf)  # DeepSpeed's parsing may change it; the ranks get ``conf`` as it is
    if world_size > 1 and "train_micro_batch_size_per_gpu" in checked:
        checked.pop("train_batch_size", None)
    try:
        DeepSpeedConfig(checked, mpu=None)
    except (AssertionError, ValueError, TypeError, KeyError, DeepSpeedConfigError) as e:
        raise ConfigError(f"DeepSpeed config {path}: {_deepspeed_says(e, conf)}; fix it (configs/zero2.json is a "
                          "config DeepSpeed accepts), or leave out --ds-config") from None


def _deepspeed_says(e: Exception, conf: dict) -> str:
    """DeepSpeed's refusal on one line: a pydantic error as ``section.key: message, got value`` (the section is
    the config's own key holding it), anything else as DeepSpeed words it, with the DeepSpeed function that
    raised it where the message does not name a setting (a ``TypeError`` from comparing a string)."""
    if isinstance(e, ValidationError):
        said = []
        for err in e.errors():
            loc = ".".join(str(x) for x in err["loc"])
            holders = [k for k, v in conf.items() if isinstance(v, dict) and err["loc"] and err["loc"][0] in v]
            where = f"{holders[0] if len(holders) == 1 else e.title}.{loc}"
            said.append(f"{where}: {err['msg']}" + ("" if err["type"] == "extra_forbidden" else
                                                    f", got {err.get('input')!r}"))
        return "; ".join(said)
    text = " ".join(str(e).split()) or type(e).__name__
    if not isinstance(e, TypeError | KeyError):  # DeepSpeed's own assertions and errors say what is wrong
        return text
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "deepspeed" in f.filename]
    return f"{text} ({type(e).__name__} in DeepSpeed's {frames[-1].name})" if frames else f"{type(e).__name__}: {text}"


def check_parent_files(name: str, files, header: dict, manifest: dict) -> None:
    """A parent's own files against each other and against the data, from its headers alone."""
    check_parent_config_matches_weights(name, files.config, header)
    check_parent_fits_data(name, header, manifest)


def preflight(*, verifier: str, layer: dict, manifest: dict, vocab: dict[str, torch.Tensor],
              parent_files=None, header: dict | None = None, vocab_policy: str = "parent",
              parent_name: str | None = None, parent_aux_layers: list[int] | None = None) -> dict[str, float]:
    """Every check before launch; returns ``{"seconds": ...}``. Raises the first problem found.
    ``parent_aux_layers``: the ids vLLM captures for the layers the parent was trained on
    (:func:`draftline.drafter.aux_ids.as_vllm_reads`); default: its config's, read literally."""
    t0 = time.perf_counter()

    if parent_aux_layers is None and parent_files is not None:
        parent_aux_layers = aux_of(parent_files.config)
    aux = parent_aux_layers or manifest["aux_layer_ids"]
    check_verifier(verifier, layer, manifest)
    shapes = drafter_shapes(verifier, layer, aux_layer_ids=aux, draft_vocab_size=int(vocab["d2t"].numel()))
    check_data(shapes, manifest, aux, f"parent {parent_name}" if parent_name and parent_files is not None else
               "the drafter")
    check_vocab(vocab, shapes, manifest["vocab_size"])
    if parent_files is not None:
        check_parent(parent_files, shapes, rebuild=vocab_policy == "rebuild", header=header)
    return {"seconds": time.perf_counter() - t0}


def check_same_verifier(manifest: dict, other: dict, ref: str) -> None:
    """An evaluation set must come from the same verifier and aux layers as the training data."""
    for key in ("verifier_id", "aux_layer_ids", "hidden_size", "vocab_size"):
        a, b = manifest.get(key), other.get(key)
        if a is not None and b is not None and a != b:
            raise DataError(f"evaluation set {ref} has {key} {b}, the training data {a}: prepare the evaluation "
                            "set with the same verifier and --aux-layers")
