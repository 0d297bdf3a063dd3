"""``draftline inspect``: what a drafter checkpoint is, read from its headers and config alone.

A directory is read in place. ``models:/…`` reads the version's ``checksums.json`` and ``config.json`` and the
first bytes of each weights file (its safetensors header), from the pull cache when a file is there and by
range reads otherwise. ``runs:/<finetune run>`` (or ``…/weights``, or ``…/checkpoints``, the ZeRO checkpoints a
finetune keeps) describes the weights the run handed on. ``bytes_downloaded`` says what it cost.
"""

from __future__ import annotations

import json
from pathlib import Path

from draftline import names, tracking
from draftline.drafter.checkpoints import detect_layout, find_checkpoint, read_header
from draftline.drafter.handoff import WEIGHTS
from draftline.drafter.shape import MIDLAYER_PREFIX, SPECULATORS_PREFIX, aux_layer_ids, key_remap
from draftline.errors import CheckpointError, DataError
from draftline.registry.blobcache import BlobCache
from draftline.registry.remote_header import ArtifactDir
from draftline.registry.transfer import CHECKSUMS
from draftline.registry.versions import resolve_version
from draftline.tracking import parse_run_ref, tracking_uri
from draftline.util import files_digest


def describe(target: str, *, allow_pickle: bool = False) -> dict:
    if target.startswith(("runs:/", "models:/")):
        tracking.setup_read_only()
        return _remote(target)
    files = find_checkpoint(Path(target), allow_pickle=allow_pickle)
    return summarise(read_header(files), _local_config(files.root, files.config), target,
                     [p.name for p in files.weights], files_digest(files.weights), bytes_downloaded=0)


def _local_config(root: Path, config: dict) -> dict:
    meta = root / "training_metadata.json"
    if not config and meta.is_file():
        return _config_from_metadata(json.loads(meta.read_text()))
    return config


def _config_from_metadata(meta: dict) -> dict:
    """A handed-on weights folder has no config.json: its lineage names the verifier and the aux layers."""
    lin = meta.get("lineage", {})
    aux = lin.get(names.VERIFIER_AUX_LAYERS)
    if isinstance(aux, str):
        aux = [int(x) for x in aux.strip("[]").split(",") if x.strip()]
    return {"eagle_aux_hidden_state_layer_ids": aux,
            "speculators_config": {"verifier": {"name_or_path": lin.get(names.VERIFIER_NAME_OR_PATH)}}}


def _remote(target: str) -> dict:
    client = tracking.client()
    if target.startswith("models:/"):
        name, mv = resolve_version(client, target)
        where = ArtifactDir(client.get_model_version_download_uri(name, mv.version))
        checksums = where.read_json(CHECKSUMS)
        config = where.read_json("config.json") if "config.json" in checksums else {}
        weights = sorted(n for n in checksums if n.endswith(".safetensors"))
        header: dict = {}
        cache = BlobCache()
        for w in weights:
            blob = cache.get(checksums[w])
            header.update(_blob_header(blob) if blob else where.safetensors_header(w))  # the pull cache first
        sha = ",".join(checksums[w] for w in weights) if len(weights) > 1 else checksums[weights[0]] if weights \
            else None
        return summarise(header, config, target, weights, sha, bytes_downloaded=where.downloaded,
                         version=f"models:/{name}/{mv.version}")

    run_id, path = parse_run_ref(target)
    try:
        run = client.get_run(run_id)
    except Exception:  # noqa: BLE001
        raise DataError(f"{target}: run {run_id} does not exist on {tracking_uri()}") from None
    root = ArtifactDir(run.info.artifact_uri)
    note = None
    if path in (None, "checkpoints", "checkpoints/") and run.data.tags.get(names.STEP) == "finetune":
        if path:
            note = f"{target} holds DeepSpeed ZeRO checkpoints (optimizer state included); described: the " \
                   f"weights the run handed on, runs:/{run_id}/{WEIGHTS}"
        path = WEIGHTS
    files = [n for n, is_dir in root.list(path) if not is_dir]
    weights = sorted(n for n in files if n.endswith(".safetensors"))
    if not weights:
        raise CheckpointError(f"{target} holds no safetensors weights (found: "
                              f"{', '.join(Path(n).name for n in files) or 'nothing'}); for a finetune run pass "
                              f"runs:/<run>/{WEIGHTS}, for a version models:/NAME/K")
    base = path.rstrip("/") + "/" if path else ""
    config = root.read_json(base + "config.json") if base + "config.json" in files else \
        _config_from_metadata(root.read_json(base + "training_metadata.json")) \
        if base + "training_metadata.json" in files else {}
    header = {}
    for w in weights:
        header.update(root.safetensors_header(w))
    out = summarise(header, config, target, [Path(w).name for w in weights], None,
                    bytes_downloaded=root.downloaded)
    if note:
        out["note"] = note
    return out


def _blob_header(blob: Path) -> dict:
    local = ArtifactDir(str(blob.parent.resolve()))
    return local.safetensors_header(blob.name)


def summarise(header: dict, cfg: dict, target: str, files: list[str], sha256: str | None, *,
              bytes_downloaded: int, version: str | None = None) -> dict:
    layout = detect_layout(header)
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
    n_params = 0
    for s, _ in header.values():
        count = 1
        for d in s:
            count *= d
        n_params += count
    out = {
        "target": target,
        "layout": layout,
        "key_remap": key_remap(layout),
        "keys": len(header),
        "parameters": n_params,
        "hidden_size": hidden,
        "num_aux_hidden_states": fc[1] // hidden,
        "draft_vocab_size": lm_head[0] if lm_head else cfg.get("draft_vocab_size"),
        "target_vocab_size": t2d[0] if t2d else tl.get("vocab_size"),
        "aux_layer_ids": aux_layer_ids(cfg),
        "verifier": ((cfg.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path"),
        "dtypes": sorted({dt for _, dt in header.values()}),
        "files": files,
        "sha256": sha256,
        "bytes_downloaded": bytes_downloaded,
    }
    if version:
        out["version"] = version
    return out


def render(d: dict) -> str:
    """The summary for people."""
    lines = [f"{d.get('version') or d['target']}: EAGLE-3 drafter, {d['layout']} layout"
             + (f" (loads with key remap {d['key_remap']})" if d["key_remap"] not in (None, "none") else ""),
             f"  parameters  {d['parameters']:,} in {d['keys']} tensors ({', '.join(d['dtypes'])})",
             f"  hidden {d['hidden_size']}, {d['num_aux_hidden_states']} aux hidden states"
             + (f" from verifier layers {d['aux_layer_ids']}" if d["aux_layer_ids"] else "")
             + f"; draft vocabulary {d['draft_vocab_size']} of {d['target_vocab_size']}",
             f"  verifier    {d['verifier'] or '(not recorded)'}",
             f"  files       {', '.join(d['files'])}" + (f"  sha256 {d['sha256'][:16]}…" if d["sha256"] else ""),
             f"  read        headers only; {d['bytes_downloaded']:,} bytes downloaded"]
    if d.get("note"):
        lines.append(f"  note        {d['note']}")
    return "\n".join(lines)
