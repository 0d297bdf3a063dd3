"""Verified transfers of exported drafters.

Every file of an export is named with its sha256 in ``checksums.json`` (and in the version's
``export.checksums`` tag). A pull takes that list from the tag, or downloads ``checksums.json`` for a version
exported before the tag, then downloads each file it names, one GET each, through MLflow's own artifact
repository (so any store MLflow supports works), hashing the bytes on a second thread *while* they arrive
instead of re-reading the file afterwards. Each download is written once, into the destination's staging folder;
where the cache fills (:mod:`draftline.registry.blobcache`: where it clones, or was asked for), its copy is
made afterwards from that verified file, only if the cache does not hold the digest yet. A file whose digest the cache holds, unchanged
since it was verified, is not downloaded at all: the blob is cloned or copied into place. The destination only
ever receives a complete, verified directory: files are assembled beside it and moved in last.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath

import mlflow
from mlflow.exceptions import MlflowException
from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository
from tqdm.auto import tqdm

from draftline.console import bar_kwargs
from draftline.errors import DraftlineError, VerificationError
from draftline.mlflow_errors import absent, raise_failure, unavailable
from draftline.registry.blobcache import BlobCache, clone_or_copy, scratch_prefix, sweep_scratch
from draftline.registry.retry import retrying
from draftline.util import atomic_write_text, file_sha256, manifest_digest

CHECKSUMS = "checksums.json"
_CHUNK = 8 << 20
_POLL_S = 0.02


class _GrowingFileHasher(threading.Thread):
    """sha256 of a file that another thread is still writing, read as it grows (from the page cache): the bytes
    hashed are the bytes on disk, and the file is written once. It waits ``_POLL_S`` between reads that find
    nothing new: a shorter wait costs a fleet of pullers sharing a few cores more in system calls than the
    hashing itself."""

    def __init__(self, path: Path, on_bytes=None):
        super().__init__(daemon=True)
        self.path, self.done, self.size = path, threading.Event(), 0
        self.digest: str | None = None
        self.on_bytes = on_bytes or (lambda n: None)

    def run(self) -> None:
        h = hashlib.sha256()
        while not self.path.exists() and not self.done.is_set():
            time.sleep(_POLL_S)
        with contextlib.suppress(FileNotFoundError), open(self.path, "rb") as f:
            while True:
                block = f.read(_CHUNK)
                if not block and self.done.is_set():
                    block = f.read()
                    if not block:
                        break
                elif not block:
                    time.sleep(_POLL_S)
                    continue
                h.update(block)
                self.size += len(block)
                self.on_bytes(len(block))
        self.digest = h.hexdigest()

    def result(self, path: Path) -> str:
        """The digest of ``path`` once its writer is done: the one computed while it grew, or, if the writer did
        not write it front to back (a store that renames at the end), a second read of the file."""
        self.done.set()
        self.join()
        with contextlib.suppress(FileNotFoundError):
            if self.digest is not None and self.size == path.stat().st_size:
                return self.digest
            return file_sha256(path)
        return "nothing"


def download_verified(repo, name: str, digest: str, into: Path, on_bytes=None) -> Path:
    """Download the file ``name`` of the artifact repository ``repo`` into ``into/<basename>`` and require its
    sha256 to be ``digest``. One GET: the repository's own single-file download (what its
    ``download_artifacts`` calls after listing the path to learn it is a file, a request a pull that knows its
    files does not need). The bytes are written once, by the download, and hashed as the file grows."""
    target = into / PurePosixPath(name).name
    hasher = _GrowingFileHasher(target, on_bytes)
    hasher.start()
    try:
        repo._download_file(remote_file_path=name, local_path=str(target))  # noqa: SLF001  (every store implements it)
    finally:
        got = hasher.result(target)
    if got != digest:
        target.unlink(missing_ok=True)
        raise VerificationError(f"{name} arrived with sha256 {got[:12]}…, not the {digest[:12]}… that "
                                f"{CHECKSUMS} names: the stored copy was altered or corrupted; refusing it")
    return target


def artifact_repository(base_uri: str):
    """MLflow's artifact repository for ``base_uri`` (any store MLflow supports)."""
    return get_artifact_repository(base_uri)


def verify_directory(directory: Path) -> dict:
    """Re-hash every file a pulled directory's ``checksums.json`` names (``pull --verify-only``): returns the
    file count and bytes; raises :class:`VerificationError` naming the first file missing or altered."""
    directory = Path(directory)
    try:
        manifest = json.loads((directory / CHECKSUMS).read_text())
    except FileNotFoundError:
        raise VerificationError(f"{directory} has no {CHECKSUMS}: not a directory draftline pulled") from None
    except (OSError, ValueError) as e:
        raise VerificationError(f"{directory / CHECKSUMS} is unreadable ({e}): pull the version again") from None
    if not isinstance(manifest, dict):
        raise VerificationError(f"{directory / CHECKSUMS} is not a mapping of file: sha256; pull the version again")
    _safe_names(manifest, directory.resolve())
    total = 0
    for name, digest in sorted(manifest.items()):
        path = directory / name
        if not path.is_file():
            raise VerificationError(f"{path} is missing: pull the version again")
        if file_sha256(path) != digest:
            raise VerificationError(f"{path} does not have the sha256 {CHECKSUMS} names ({digest[:12]}…): it was "
                                    "altered; pull the version again")
        total += path.stat().st_size
    return {"path": str(directory.absolute()), "files": len(manifest), "bytes": total,
            "manifest_sha256": manifest_digest(manifest)}


def _safe_names(manifest: dict[str, str], root: Path) -> None:
    for name, digest in manifest.items():
        p = PurePosixPath(name)
        if p.is_absolute() or ".." in p.parts or not p.parts or not (root / p).resolve().is_relative_to(root):
            raise VerificationError(f"{CHECKSUMS} names {name!r}, which escapes the destination; refusing it")
        if not (isinstance(digest, str) and len(digest) == 64):
            raise VerificationError(f"{CHECKSUMS} gives {name!r} no sha256; refusing it")


def fetch_directory(base_uri: str, dest: Path, *, cache: BlobCache | None, progress: bool = True,
                    expected_digest: str | None = None, manifest: dict | None = None,
                    check: Callable[[Path], None] | None = None) -> dict:
    """Assemble the export at ``base_uri`` into ``dest``, every file verified; returns what was transferred.

    With ``expected_digest`` (the version's ``export.sha256`` tag, set by the registry at export time),
    ``checksums.json`` itself must match it, so rewriting a file and its checksum in the store is caught too.
    ``manifest`` (the version's ``export.checksums`` tag) saves reading ``checksums.json`` from the store; it
    must match ``expected_digest`` just the same, and is what DEST's ``checksums.json`` holds. ``check``: called
    with the verified directory before it goes into place (``pull`` refuses one vLLM would serve wrongly there).
    ``dest`` is replaced only once everything is in place; on any failure it is left as it was.
    """

    dest = Path(dest).absolute()
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DraftlineError(f"cannot create {dest.parent} for the pull ({e.strerror}): choose a --dest you can "
                             "write") from None
    for folder in (dest.parent, dest) if dest.is_dir() else (dest.parent,):
        if not os.access(folder, os.W_OK | os.X_OK):
            raise DraftlineError(f"cannot write into {folder} (permission denied): choose a --dest you can write, "
                                 "or fix its permissions; nothing was downloaded")
    stats = {"files": 0, "downloaded_bytes": 0, "cached_bytes": 0}
    sweep_scratch(dest.parent, f".{dest.name}.partial-")
    with tempfile.TemporaryDirectory(prefix=scratch_prefix(f".{dest.name}.partial-"), dir=dest.parent) as scratch, \
            _quiet_mlflow():
        staging = Path(scratch)
        if cache:
            cache.fills(staging)  # decided once, before the downloads
        repo = artifact_repository(base_uri)
        if manifest is None or not expected_digest:
            manifest = retrying(f"download {CHECKSUMS} of {base_uri}", lambda: _read_manifest(base_uri, staging))
        else:
            atomic_write_text(staging / CHECKSUMS, json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        if not isinstance(manifest, dict):
            raise VerificationError(f"{CHECKSUMS} of {base_uri} is not a mapping of file: sha256")
        if expected_digest and manifest_digest(manifest) != expected_digest:
            raise VerificationError(f"{CHECKSUMS} of {base_uri} does not match the export.sha256 the registry "
                                    "recorded at export time: the stored files were rewritten; refusing them")
        _safe_names(manifest, staging.resolve())
        todo: list[tuple[str, str]] = []
        for name, digest in sorted(manifest.items()):
            blob = cache.get(digest, name) if cache else None
            if blob is None:
                todo.append((name, digest))
            else:
                assert cache is not None  # a blob comes only from a cache
                stats["cached_bytes"] += blob.stat().st_size
                cache.place(blob, digest, staging / name, name)

        with ThreadPoolExecutor(4, thread_name_prefix="draftline-pull") as pool, \
                tqdm(desc="pull (sha256 while downloading)", unit="B", unit_scale=True, **bar_kwargs(progress and bool(todo)),
                     file=sys.stderr) as bar:
            for size in pool.map(lambda item: _fetch_one(repo, base_uri, item[0], item[1], staging, cache, bar.update),
                                 todo):
                stats["downloaded_bytes"] += size
        stats["files"] = len(manifest)
        if check is not None:
            check(staging)
        _install(staging, dest)
    return stats


def _read_manifest(base_uri: str, staging: Path) -> dict:
    try:
        listed = Path(mlflow.artifacts.download_artifacts(artifact_uri=f"{base_uri}/{CHECKSUMS}",
                                                          dst_path=str(staging)))
        return json.loads(listed.read_text())
    except MlflowException as e:
        if not absent(e):
            raise_failure(e, f"download {CHECKSUMS} of {base_uri}", f"READ permission on the artifacts of {base_uri}")
        raise VerificationError(f"{base_uri} has no {CHECKSUMS}: not a draftline export, refusing it "
                                f"({str(e).splitlines()[0]})") from None
    except (OSError, ValueError) as e:  # requests' errors are OSErrors too: a server gone away is retried
        if unavailable(e):
            raise
        raise VerificationError(f"{base_uri} has no readable {CHECKSUMS} ({e}): not a draftline export, "
                                "refusing it") from None


def _fetch_one(repo, base_uri: str, name: str, digest: str, staging: Path, cache: BlobCache | None,
               on_bytes) -> int:
    """Download ``name`` once, hashed as it arrives, into the destination's staging folder (a rename away from
    where the download landed); where the cache fills, its copy is then cloned or copied from that verified
    file, once, and only if the cache does not hold it yet (a pod on the same node may have put it there)."""
    target = staging / name
    target.parent.mkdir(parents=True, exist_ok=True)
    with _download_scratch(cache, staging) as tmp:
        # a download cut off by a server restart is tried again from the start, in a folder of its own
        local = retrying(f"download {name} from {base_uri}", lambda: download_verified(
            repo, name, digest, Path(tempfile.mkdtemp(dir=tmp)), on_bytes))
        size = local.stat().st_size
        os.replace(local, target)  # the download's own inode: same file system, no copy
    if cache and cache.fills(staging) and cache.get(digest, name) is None:
        with cache.scratch() as tmp:
            copy = Path(tmp) / "blob"
            clone_or_copy(target, copy)
            cache.put(copy, digest)
    return size


def _download_scratch(cache: BlobCache | None, staging: Path):
    """Where a download lands before it is verified: the cache's scratch folder when the cache is on the
    destination's file system (a puller killed mid-download leaves its partial file where the next pull on the
    node sweeps it), else a folder in the destination's staging folder. Either way a rename from ``staging``."""
    if cache is not None:
        cache.root.mkdir(parents=True, exist_ok=True)
        if os.stat(cache.root).st_dev == os.stat(staging).st_dev:
            return cache.scratch()
    return tempfile.TemporaryDirectory(prefix=".incoming-", dir=staging)


@contextlib.contextmanager
def _quiet_mlflow():
    """One progress bar per file from MLflow is noise here; the pull reports its own totals."""
    key = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
    before = os.environ.get(key)
    os.environ[key] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


def _install(staging: Path, dest: Path) -> None:
    """Move the verified files over ``dest``: a missing or empty ``dest`` is replaced whole; otherwise the
    pulled files replace theirs one by one (other files there are left alone)."""
    if dest.is_dir() and not any(dest.iterdir()):
        dest.rmdir()
    if not dest.exists():
        os.replace(staging, dest)
        staging.mkdir()  # TemporaryDirectory removes it on exit
        umask = os.umask(0)
        os.umask(umask)
        dest.chmod(0o777 & ~umask)  # a new folder as mkdir makes it, not the staging folder's 0700
        return
    for p in sorted(staging.rglob("*"), key=lambda p: p.name == CHECKSUMS):  # the manifest last
        if p.is_file():
            target = dest / p.relative_to(staging)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(p, target)
