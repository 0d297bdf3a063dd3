"""Resolve ``init`` to a parent drafter on local disk, with the facts lineage records about it.

``init`` is one of: ``random``; a catalog name (``configs/parents.yaml``); a local directory; a Hugging Face
repo id already in the local cache (nothing is downloaded); ``models:/NAME/VERSION``, ``models:/NAME/STAGE``
or ``models:/NAME@alias`` (a drafter registered before, so lineage chains across generations).
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from draftline.config import project_root, shipped
from draftline.errors import ConfigError, ParentNotFound


class CatalogEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    source: str
    revision: str = "main"
    layout: str = Field("midlayer", pattern="^(midlayer|speculators)$")
    verifier: str | None = None
    description: str = ""
    local_dirs: list[str] = Field(default_factory=list)


@dataclass
class Parent:
    init: str
    name: str  # catalog name, directory name, repo id, or registered model name
    source: str  # where it came from: repo id, absolute path, or models:/NAME/VERSION
    revision: str
    path: Path | None  # local directory with the weights; None for random
    model_version: str | None = None  # models:/NAME/K when it came from our registry
    run_id: str | None = None  # the run that registered it

    @property
    def is_random(self) -> bool:
        return self.path is None


def catalog_path() -> Path:
    return Path(os.environ.get("DRAFTLINE_PARENTS") or shipped("configs", "parents.yaml"))


def load_catalog(path: Path | None = None) -> dict[str, CatalogEntry]:
    path = path or catalog_path()
    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
        return {k: CatalogEntry(**v) for k, v in (raw.get("parents") or {}).items()}
    except FileNotFoundError:
        raise ConfigError(f"parent catalog {path} does not exist (set DRAFTLINE_PARENTS)") from None
    except (yaml.YAMLError, ValidationError, TypeError, AttributeError) as e:
        raise ConfigError(f"parent catalog {path} is invalid: {e}") from None


def _expand(p: str) -> Path | None:
    """Expand ~ and ${VAR}; a candidate naming an unset variable does not apply. Relative paths are taken
    from the working directory, then from the checkout draftline runs from (if any)."""
    expanded = os.path.expanduser(os.path.expandvars(p))
    if "$" in expanded:
        return None
    path = Path(expanded)
    root = project_root()
    if path.is_absolute() or path.exists() or root is None:
        return path
    return root / path


def _hf_cached(repo_id: str, revision: str | None = None) -> Path | None:
    try:
        from huggingface_hub import snapshot_download

        # HF_HUB_CACHE is read now, not at import, so a caller's setting always counts
        return Path(snapshot_download(repo_id, revision=revision, local_files_only=True,
                                      cache_dir=os.environ.get("HF_HUB_CACHE") or None))
    except Exception:  # noqa: BLE001
        return None


def _from_registry(uri: str, cache: Path) -> Parent:
    from mlflow import MlflowClient

    from draftline.registry.versions import resolve_version

    name, version = resolve_version(MlflowClient(), uri)
    from draftline.registry.transfer import BlobCache, fetch_directory

    dest = cache / "registry" / name / str(version.version)
    client = MlflowClient()
    # verified on every use: the files come from the content-addressed cache when they are there already
    fetch_directory(client.get_model_version_download_uri(name, version.version), dest, cache=BlobCache())
    return Parent(init=uri, name=name, source=f"models:/{name}/{version.version}", revision=str(version.version),
                  path=dest, model_version=f"models:/{name}/{version.version}", run_id=version.run_id)


def resolve_init(init: str, *, cache: Path | None = None) -> Parent:
    """Find the parent ``init`` names. Raises :class:`ParentNotFound` with what to do."""
    init = init.strip()
    if init in ("", "random", "none"):
        return Parent(init="random", name="random", source="none", revision="none", path=None)
    if init.startswith("models:/"):
        return _from_registry(init, cache or Path(os.environ.get("DRAFTLINE_WORK", "work")) / "cache")
    catalog = load_catalog()
    if init in catalog:
        entry = catalog[init]
        for cand in entry.local_dirs:
            path = _expand(cand)
            if path is not None and path.is_dir():
                return Parent(init=init, name=init, source=entry.source, revision=entry.revision,
                              path=path.resolve())
        cached = _hf_cached(entry.source, None if entry.revision == "main" else entry.revision)
        if cached:
            return Parent(init=init, name=init, source=entry.source, revision=entry.revision, path=cached)
        where = [c for c in entry.local_dirs]
        raise ParentNotFound(
            f"parent '{init}' ({entry.source}) is not on this machine and nothing is downloaded at run time. "
            f"Download it first, e.g. `huggingface-cli download {entry.source} --local-dir "
            f"$DRAFTLINE_PARENTS_DIR/{init}` (config.json + model.safetensors), or put it in one of: "
            f"{', '.join(where)}; or pass init=<that directory>"
        )
    path = Path(init).expanduser()
    if path.is_dir():
        return Parent(init=init, name=path.resolve().name, source=str(path.resolve()), revision="local",
                      path=path.resolve())
    if re.fullmatch(r"[\w.-]+/[\w.-]+", init) and not path.exists():
        cached = _hf_cached(init)
        if cached:
            return Parent(init=init, name=init, source=init, revision=cached.name, path=cached)
    near = difflib.get_close_matches(init, list(catalog), n=1)
    raise ParentNotFound(
        f"init '{init}' is not 'random', a catalog name ({', '.join(sorted(catalog))}), a local directory, a "
        "Hugging Face repo in the local cache, or a models:/ URI" + (f"; did you mean '{near[0]}'?" if near else "")
    )
