"""The lineage contract (DESIGN.md): what every run and model version records about what it was made from."""

from __future__ import annotations

import json
import platform
import subprocess
from importlib import metadata
from pathlib import Path

LINEAGE_FILE = "lineage.json"
METADATA_FILE = "training_metadata.json"

# Model-version tags copied from the finetune run's params.
VERSION_TAG_PARAMS = (
    "init", "parent.name", "parent.source", "parent.revision", "parent.sha256", "parent.layout",
    "parent.key_remap", "vocab.policy", "vocab.draft_size", "verifier.name_or_path", "verifier.aux_layers",
    "data.digest", "train.pairing",
)
HEADLINE_METRICS = ("val/acceptance_length", "train/acceptance_length", "train/full_acc_0", "train/loss")


def versions() -> dict[str, str]:
    out = {}
    for pkg in ("torch", "speculators", "deepspeed", "transformers", "mlflow", "safetensors", "draftline"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = "absent"
    out["python"] = platform.python_version()
    return out


def git_commit(root: Path | None = None) -> str:
    from draftline.config import project_root

    root = root or project_root()
    if root is None:  # an installed wheel: its version is recorded instead
        return "unknown"
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def environment_tags() -> dict[str, str]:
    tags = {f"draftline.version.{k}": v for k, v in versions().items()}
    tags["draftline.git_commit"] = git_commit()
    return tags


def parent_params(parent, *, sha256: str, layout: str, key_remap: str) -> dict[str, str]:
    return {
        "init": parent.init,
        "parent.name": parent.name,
        "parent.source": parent.source,
        "parent.revision": parent.revision,
        "parent.sha256": sha256,
        "parent.layout": layout,
        "parent.key_remap": key_remap,
    }


def parent_tags(parent, data_run_id: str | None) -> dict[str, str]:
    tags = {}
    if parent.model_version:
        tags["draftline.parent.model_version"] = parent.model_version
    if parent.run_id:
        tags["draftline.parent.run_id"] = parent.run_id
    if data_run_id:
        tags["draftline.data.run_id"] = data_run_id
    return tags


def training_metadata(params: dict[str, object], vocab_counts: dict[str, int], extra: dict | None = None) -> dict:
    return {
        "lineage": {k: params[k] for k in params if k.split(".")[0] in
                    ("init", "parent", "vocab", "verifier", "data")},
        "vocab_counts": vocab_counts,
        "training": {k: params[k] for k in params if k.split(".")[0] in
                     ("zero", "world_size", "ttt_steps", "optimizer", "train")},
        "versions": versions(),
        "git_commit": git_commit(),
        **(extra or {}),
    }


def write_json(path: Path, obj: dict) -> Path:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")
    return path
