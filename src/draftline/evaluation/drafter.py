"""Load a drafter directory (speculators layout, or SpecForge/AQ-MedAI ``midlayer.*``) for decoding on this host."""

from __future__ import annotations

import json
from pathlib import Path


def load_drafter(verifier_dir: str | Path, drafter_dir: str | Path, *, dtype=None, allow_pickle: bool = False):
    """speculators' ``Eagle3DraftModel`` for ``verifier_dir`` with the weights, vocabulary and aux layers of
    ``drafter_dir``, in eval mode, with ``sdpa`` attention (float32 unless ``dtype``).
    Raises :class:`~draftline.errors.CheckpointError` when the directory is no EAGLE-3 drafter for it."""
    import torch

    from draftline.checkpoints import find_checkpoint, load_into_model, read_tensors
    from draftline.drafter_shape import aux_layer_ids, default_aux_layers, layer_config
    from draftline.errors import CheckpointError
    from draftline.train.model import build_draft_model

    drafter_dir = Path(drafter_dir)
    files = find_checkpoint(drafter_dir, allow_pickle=allow_pickle)
    vocab = read_tensors(files, {"d2t", "t2d"})
    if set(vocab) != {"d2t", "t2d"}:
        raise CheckpointError(f"drafter {drafter_dir} has no d2t/t2d: not an EAGLE-3 drafter with a draft "
                              "vocabulary")
    cfg_file = drafter_dir / "config.json"
    config = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
    layer = layer_config(str(verifier_dir), config)
    aux = aux_layer_ids(config) or default_aux_layers(
        json.loads((Path(verifier_dir) / "config.json").read_text())["num_hidden_layers"])
    norm_before_residual = bool(config.get("norm_before_residual", False))
    model = build_draft_model(str(verifier_dir), d2t=vocab["d2t"], t2d=vocab["t2d"], aux_layer_ids=aux,
                              draft_vocab_size=int(vocab["d2t"].numel()), attn_impl="sdpa",
                              dtype=dtype or torch.float32, norm_before_residual=norm_before_residual, layer=layer)
    load_into_model(model, files)
    return model.eval()
