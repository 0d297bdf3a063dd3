"""Resolve ``init`` to a parent drafter on local disk, with the facts lineage records about it.

``init`` is one of: ``random``; a catalog name (``configs/parents.yaml``); a local directory; a Hugging Face
repo id; ``models:/NAME/VERSION``, ``models:/NAME/STAGE`` or ``models:/NAME@alias`` (a drafter registered
before, so lineage chains across generations).

A catalog parent or a repo id is looked for on this machine first (the catalog's directories, then the local
Hugging Face cache). When it is in neither, it is downloaded into the Hugging Face cache at the catalog's
revision, its config and safetensors weights only (never ``training_state.pt`` or any other pickle), unless
``HF_HUB_OFFLINE`` is set: then the message says what to download and where to put it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import constants as hf_constants
from huggingface_hub import snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from draftline import tracking
from draftline.config import project_root, work_dir
from draftline.console import say
from draftline.drafter.aux_ids import as_vllm_reads, aux_layer_ids, parent_convention
from draftline.drafter.catalog import RANDOM, REPO_ID, CatalogEntry, catalog_path, load_catalog, not_a_parent
from draftline.errors import ParentNotFound
from draftline.registry.blobcache import BlobCache
from draftline.registry.transfer import fetch_directory
from draftline.registry.versions import resolve_version

# What a parent is read from. Everything else in the repo stays there: SpecForge's `training_state.pt` (optimizer
# state, a pickle) is as big as the weights and draftline never loads a pickle (*.pt, *.bin, *.pth, *.pkl).
PARENT_FILES = ["config.json", "*.safetensors", "*.safetensors.index.json", "README.md"]
LOCAL_ONLY = "local"  # a catalog revision naming no Hub repo (the tiny parent `make-tiny` writes): never downloaded


@dataclass
class Parent:
    init: str
    name: str  # catalog name, directory name, repo id, or registered model name
    source: str  # where it came from: repo id, absolute path, or models:/NAME/VERSION
    revision: str  # the Hub commit (the snapshot's folder name), the catalog's revision, "local", or the version
    path: Path | None  # local directory with the weights; None for random
    model_version: str | None = None  # models:/NAME/K when it came from our registry
    run_id: str | None = None  # the run that registered it

    @property
    def is_random(self) -> bool:
        return self.path is None


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


def hf_offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) as huggingface_hub reads it, but read now: the library
    reads it once, at import, and a caller's later setting must count."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
    return value.strip().upper() in hf_constants.ENV_VARS_TRUE_VALUES if value else False


def _hub_cache() -> str:
    # HF_HUB_CACHE is read now, not at import, so a caller's setting always counts
    return os.environ.get("HF_HUB_CACHE") or hf_constants.HF_HUB_CACHE


def _has_weights(path: Path) -> bool:
    return any(path.rglob("*.safetensors"))


def _hf_cached(repo_id: str, revision: str | None = None) -> Path | None:
    """The cached snapshot of ``repo_id`` at ``revision`` that holds safetensors weights, or None. The same
    patterns as the download: a snapshot fetched without the training state is complete."""
    try:
        path = Path(snapshot_download(repo_id, revision=revision, local_files_only=True,
                                      allow_patterns=PARENT_FILES, cache_dir=_hub_cache()))
    except Exception:  # noqa: BLE001 (not in the cache, or a partial snapshot: either way, not found here)
        return None
    return path if _has_weights(path) else None


def _download_failure(e: Exception, repo_id: str, revision: str, catalog_entry: bool) -> str:
    """Why the download of ``repo_id`` failed and what to do, in one line."""
    login = "log in with `hf auth login` or set HF_TOKEN"
    if isinstance(e, GatedRepoError):
        return (f"the repo is gated and this machine's token may not read it: accept its terms at "
                f"{hf_constants.ENDPOINT}/{repo_id}, then {login}")
    if isinstance(e, RepositoryNotFoundError):
        where = f"the catalog ({catalog_path()})" if catalog_entry else "init"
        return (f"the Hub has no such repo, or it is private or gated and needs a token: check the repo id in "
                f"{where}, or {login}")
    if isinstance(e, RevisionNotFoundError):
        where = f"its `revision:` in {catalog_path()}" if catalog_entry else "the revision"
        return f"the repo has no revision '{revision}': fix {where}"
    if isinstance(e, HfHubHTTPError) and e.response.status_code in (401, 403):
        return f"the Hub refused access (HTTP {e.response.status_code}): check the token, or {login}"
    if isinstance(e, OfflineModeIsEnabled) or isinstance(e.__cause__, OfflineModeIsEnabled):
        return "huggingface_hub is in offline mode (HF_HUB_OFFLINE was set when it was imported)"
    cause = e.__cause__ if isinstance(e, LocalEntryNotFoundError) and e.__cause__ is not None else e
    text = " ".join(str(cause).split()) or "no message"
    return (f"{type(cause).__name__}: {text[:300]}. Check the network, a proxy (HTTPS_PROXY) or HF_ENDPOINT, or "
            "download it on a machine that can reach the Hub and copy it here")


def _download(init: str, repo_id: str, revision: str, *, catalog_entry: bool) -> Path:
    """Download ``repo_id`` at ``revision`` into the Hugging Face cache: the config and safetensors weights,
    never a pickle. Raises :class:`ParentNotFound` with the cause and the fix."""
    cache = _hub_cache()
    say(f"downloading parent '{init}': {hf_constants.ENDPOINT}/{repo_id} at revision {revision} "
        f"({', '.join(PARENT_FILES)}) into {cache}")
    try:
        path = Path(snapshot_download(repo_id, revision=revision, allow_patterns=PARENT_FILES, cache_dir=cache))
    except Exception as e:  # noqa: BLE001 (network, proxy, token, disk, a bad id: the user's to fix; one line says which)
        raise ParentNotFound(f"could not download parent '{init}' ({repo_id} at revision {revision}): "
                             f"{_download_failure(e, repo_id, revision, catalog_entry)}") from e
    if not _has_weights(path):
        raise ParentNotFound(f"parent '{init}' ({repo_id} at revision {revision}) has no safetensors weights "
                             f"(downloaded to {path}); draftline never loads pickles (*.pt, *.bin): convert the "
                             "weights to safetensors and pass init=<that directory>")
    return path


def _from_registry(uri: str, cache: Path) -> Parent:
    name, version = resolve_version(tracking.client(), uri)

    dest = cache / "registry" / name / str(version.version)
    client = tracking.client()
    # verified on every use: the files come from the content-addressed cache when they are there already
    fetch_directory(client.get_model_version_download_uri(name, version.version), dest, cache=BlobCache())
    return Parent(init=uri, name=name, source=f"models:/{name}/{version.version}", revision=str(version.version),
                  path=dest, model_version=f"models:/{name}/{version.version}", run_id=version.run_id)


def _from_catalog(init: str, entry: CatalogEntry) -> Parent:
    for cand in entry.local_dirs:
        path = _expand(cand)
        if path is not None and path.is_dir():
            return Parent(init=init, name=init, source=entry.source, revision=entry.revision,
                          path=path.resolve())
    hub = entry.revision != LOCAL_ONLY
    cached = _hf_cached(entry.source, entry.revision) if hub else None
    if cached is None and hub and not hf_offline():
        cached = _download(init, entry.source, entry.revision, catalog_entry=True)
    if cached is not None:
        return Parent(init=init, name=init, source=entry.source, revision=cached.name, path=cached)
    offline = " (HF_HUB_OFFLINE is set, so draftline downloads nothing)" if hub else ""
    pinned = f" --revision {entry.revision}" if hub and entry.revision != hf_constants.DEFAULT_REVISION else ""
    raise ParentNotFound(
        f"parent '{init}' ({entry.source}) is not on this machine{offline}. "
        f"Download it first, e.g. `huggingface-cli download {entry.source}{pinned} --local-dir "
        f"$DRAFTLINE_PARENTS_DIR/{init}` (config.json + model.safetensors), or put it in one of: "
        f"{', '.join(entry.local_dirs)}; or pass init=<that directory>"
        + ("; or unset HF_HUB_OFFLINE to let draftline download it" if hub else "")
    )


def resolve_init(init: str, *, cache: Path | None = None) -> Parent:
    """Find the parent ``init`` names, downloading a catalog parent or a repo id that is not on this machine
    (unless ``HF_HUB_OFFLINE`` is set). Raises :class:`ParentNotFound` with what to do."""
    init = init.strip()
    if init in RANDOM:
        return Parent(init="random", name="random", source="none", revision="none", path=None)
    if init.startswith("models:/"):
        return _from_registry(init, cache or work_dir() / "cache")
    catalog = load_catalog()
    if init in catalog:
        return _from_catalog(init, catalog[init])
    path = Path(init).expanduser()
    if path.is_dir():
        return Parent(init=init, name=path.resolve().name, source=str(path.resolve()), revision="local",
                      path=path.resolve())
    offline = hf_offline()
    repo_like = REPO_ID.fullmatch(init) is not None and not path.exists()
    if repo_like:
        cached = _hf_cached(init)
        if cached is None and not offline:
            cached = _download(init, init, hf_constants.DEFAULT_REVISION, catalog_entry=False)
        if cached is not None:
            return Parent(init=init, name=init, source=init, revision=cached.name, path=cached)
    raise not_a_parent(init, catalog, offline=repo_like and offline)


def aux_reads(parent: Parent, config: dict, asked: str, num_layers: int) -> tuple[str, list[int] | None]:
    """``(convention, ids)``: whose layers the parent's aux-layer ids name (``asked``, its catalog entry,
    draftline's registry or config, speculators' format: :func:`~draftline.drafter.aux_ids.parent_convention`),
    and the ids vLLM captures for those layers; ``("none", None)`` when its config names none."""
    own = aux_layer_ids(config)
    if not own:
        return "none", None
    entry = load_catalog().get(parent.init)
    convention, _ = parent_convention(asked, catalog=entry.aux_convention if entry else None, config=config,
                                      registry=parent.model_version is not None, parent=parent.name)
    return convention, as_vllm_reads(own, convention, num_layers, parent.name)
