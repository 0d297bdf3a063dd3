"""``draftline inspect``: what a drafter checkpoint is, read from its headers and config alone."""

from __future__ import annotations

import tempfile
from pathlib import Path

from draftline.checkpoints import detect_layout, find_checkpoint, read_header, sha256_files
from draftline.drafter_shape import MIDLAYER_PREFIX, SPECULATORS_PREFIX, aux_layer_ids, key_remap
from draftline.errors import CheckpointError


def describe(target: str, *, allow_pickle: bool = False) -> dict:
    if target.startswith(("runs:/", "models:/")):
        from draftline import tracking

        tracking.setup()
        with tempfile.TemporaryDirectory(prefix="draftline-inspect-") as tmp:
            return _describe(tracking.download(target, Path(tmp)), target, allow_pickle)
    return _describe(Path(target), target, allow_pickle)


def _describe(path: Path, target: str, allow_pickle: bool) -> dict:
    files = find_checkpoint(path, allow_pickle=allow_pickle)
    header = read_header(files)
    layout = detect_layout(header)
    cfg = files.config
    prefix = MIDLAYER_PREFIX if layout == "midlayer" else SPECULATORS_PREFIX
    shapes = {k: list(s) for k, (s, _) in header.items()}
    fc = shapes.get("fc.weight")
    if fc is None or len(fc) != 2 or fc[1] % fc[0]:
        raise CheckpointError(f"{target}: fc.weight {fc} is not [hidden, aux*hidden]; not an EAGLE-3 drafter")
    hidden = fc[0]
    for key, (shape, _) in header.items():
        if key.startswith(prefix) and key.endswith(("input_layernorm.weight", "hidden_norm.weight")) \
                and list(shape) != [hidden]:
            raise CheckpointError(f"{target}: {key} is {list(shape)} but fc.weight says hidden size {hidden}")
    lm_head = shapes.get("lm_head.weight")
    if lm_head and lm_head[1] != hidden:
        raise CheckpointError(f"{target}: lm_head.weight {lm_head} does not match hidden size {hidden}")
    d2t, t2d = shapes.get("d2t"), shapes.get("t2d")
    if lm_head and d2t and d2t[0] != lm_head[0]:
        raise CheckpointError(f"{target}: d2t has {d2t[0]} rows but lm_head.weight has {lm_head[0]}")
    tl = cfg.get("transformer_layer_config", cfg)
    aux = aux_layer_ids(cfg)
    verifier = ((cfg.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    n_params = 0
    for s, _ in header.values():
        count = 1
        for d in s:
            count *= d
        n_params += count
    return {
        "target": target,
        "layout": layout,
        "key_remap": key_remap(layout),
        "keys": len(header),
        "parameters": n_params,
        "hidden_size": hidden,
        "num_aux_hidden_states": fc[1] // hidden,
        "draft_vocab_size": lm_head[0] if lm_head else cfg.get("draft_vocab_size"),
        "target_vocab_size": t2d[0] if t2d else tl.get("vocab_size"),
        "aux_layer_ids": aux,
        "verifier": verifier,
        "dtypes": sorted({dt for _, dt in header.values()}),
        "files": [p.name for p in files.weights],
        "sha256": sha256_files(files.weights),
    }
