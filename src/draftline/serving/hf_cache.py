"""A local verifier directory made loadable by its serving id, offline: the short form ``vllm serve <drafter
dir>`` replaces the model with ``speculators_config.verifier.name_or_path`` and loads it through the Hugging Face
cache. With ``HF_HUB_OFFLINE=1`` and the files under ``$HF_HUB_CACHE/models--ORG--NAME/snapshots/<rev>/`` (plus
``refs/main`` holding ``<rev>``), vLLM resolves ``ORG/NAME`` to them without a hub (measured here with SmolLM2 and
the tiny verifier)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from huggingface_hub import constants

from draftline.errors import UsageError


def hub_cache() -> Path:
    """The Hugging Face hub cache this process (and vLLM, with the same environment) reads."""
    return Path(constants.HF_HUB_CACHE)


def register(directory: Path | str, repo_id: str, *, cache: Path | None = None) -> Path:
    """Link the files of ``directory`` into the hub cache as the snapshot of ``repo_id`` at a revision named by
    their contents (a sha1 over names and sizes), and point ``refs/main`` at it; returns the snapshot folder.
    Idempotent; the files are symlinks, so the cache costs no space."""
    directory = Path(directory).expanduser().resolve()
    if repo_id.count("/") != 1 or any(not part for part in repo_id.split("/")):
        raise UsageError(f"{repo_id!r} is no Hugging Face repo id (ORG/NAME)")
    files = sorted(p for p in directory.iterdir() if p.is_file())
    rev = hashlib.sha1("".join(f"{p.name}:{p.stat().st_size};" for p in files).encode()).hexdigest()
    repo = (cache or hub_cache()) / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / rev
    snapshot.mkdir(parents=True, exist_ok=True)
    for p in files:
        link = snapshot / p.name
        if link.is_symlink() and Path(os.readlink(link)) == p:
            continue
        link.unlink(missing_ok=True)
        link.symlink_to(p)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(rev)
    return snapshot
