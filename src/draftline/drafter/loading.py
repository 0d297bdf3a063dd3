"""Load a drafter directory (speculators layout, or SpecForge/AQ-MedAI ``midlayer.*``) for decoding on this host,
by the same path finetune loads a parent: built for the verifier, weights copied in with strict keys and shapes."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from draftline.drafter.checkpoints import draft_vocab, find_checkpoint, load_into_model, read_header
from draftline.drafter.form import FORM_KEY, of_checkpoint, with_form
from draftline.drafter.model import build_draft_model
from draftline.drafter.shape import aux_layer_ids as aux_of
from draftline.drafter.shape import default_aux_layers, layer_config, require_aux_layers
from draftline.serving import hf_model


def load_drafter(verifier_dir: str | Path, drafter_dir: str | Path, *, aux_layer_ids: list[int] | None = None,
                 layer: dict | None = None, ttt_steps: int = 3, dtype=None, allow_pickle: bool = False,
                 name: str | None = None):
    """speculators' ``Eagle3DraftModel`` for ``verifier_dir`` with the weights and vocabulary of ``drafter_dir``,
    in eval mode, with ``sdpa`` attention (float32 unless ``dtype``).

    ``aux_layer_ids``: the layers the data was captured from (a drafter recording others is refused); default:
    the drafter's own, else EAGLE-3's default for the verifier. ``layer``: the decoder layer config when the
    directory does not say it (a finetune run's ``layer_config.json``). Raises
    :class:`~draftline.errors.CheckpointError` when the directory is no EAGLE-3 drafter for it."""
    drafter_dir = Path(drafter_dir)
    name = name or str(drafter_dir)
    files = find_checkpoint(drafter_dir, allow_pickle=allow_pickle)
    vocab = draft_vocab(files, int(hf_model.load_text_config(str(verifier_dir)).vocab_size))
    config = files.config or {}
    own = aux_of(config)
    if aux_layer_ids is not None:
        require_aux_layers(f"drafter {name}", own, aux_layer_ids)
    aux = list(aux_layer_ids) if aux_layer_ids is not None else own or default_aux_layers(
        json.loads((Path(verifier_dir) / "config.json").read_text())["num_hidden_layers"])
    model = build_draft_model(str(verifier_dir), d2t=vocab["d2t"], t2d=vocab["t2d"], aux_layer_ids=aux,
                              draft_vocab_size=int(vocab["d2t"].numel()), ttt_steps=ttt_steps, attn_impl="sdpa",
                              dtype=dtype or torch.float32,
                              norm_before_residual=bool(config.get("norm_before_residual", False)),
                              layer=_with_own_form(layer or layer_config(str(verifier_dir), config or None), config,
                                                   read_header(files), len(aux)))
    load_into_model(model, files)
    return model.eval()


def _with_own_form(layer: dict, config: dict, keys, aux_layers: int) -> dict:
    """The layer in the EAGLE form the drafter's own checkpoint is in (as finetune reads a parent), unless the
    layer already carries one (a finetune run's hand-off)."""
    return layer if FORM_KEY in layer else with_form(layer, of_checkpoint(config, keys, aux_layers))
