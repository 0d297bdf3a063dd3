"""The content-addressed cache pulls share: one read-only file per sha256, trusted by what the kernel says of it.

A blob enters the cache only after its bytes were hashed (a download verified as it arrived, see
:mod:`draftline.registry.transfer`). With it the cache records the blob's *witness*: size, modification time,
inode and change time (``st_ctime``). Every write, truncation, ``chmod``, ``touch`` or replacement of the file
moves its change time, and no user call sets it back (``utime`` restores mtime, never ctime), so a blob whose
witness is unchanged holds the bytes that were hashed, and a warm pull copies it without reading it twice. A
blob whose witness changed is evicted, saying so in one line, and downloaded again. What a witness cannot see is
a write that also turns back the system clock, or one made to the block device under the file system: ``pull
--verify-only DIR`` re-hashes a pulled directory for those who must rule that out.

Pulls copy blobs into place with the kernel (``copy_file_range``), never a hard link: no destination shares an
inode with the cache or another destination, so a pulled file edited in place changes nothing else.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import tempfile
import time
from pathlib import Path

from draftline.config import cache_root
from draftline.console import say
from draftline.errors import VerificationError
from draftline.util import atomic_write_text

WITNESS = ("size", "mtime_ns", "ctime_ns", "ino")


def witness(path: Path) -> dict[str, int]:
    """What the kernel says of ``path`` that any change to its bytes, mode or times moves."""
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "ino": st.st_ino}


class BlobCache:
    """One read-only file per sha256 under ``$DRAFTLINE_CACHE_DIR/blobs/sha256`` (default ``~/.cache/draftline``);
    a hit costs one kernel copy (:meth:`place`)."""

    def __init__(self, root: Path | None = None):
        self.root = (root or cache_root()) / "blobs" / "sha256"

    def _paths(self, digest: str) -> tuple[Path, Path]:
        blob = self.root / digest[:2] / digest
        return blob, blob.with_suffix(".stat")

    def get(self, digest: str, name: str | None = None) -> Path | None:
        """The blob of ``digest`` (the file ``name`` of a pull), or None. A blob whose witness is no longer the
        one recorded when it was verified is evicted, saying so in one line: the pull downloads it again."""
        blob, stat = self._paths(digest)
        try:
            recorded = json.loads(stat.read_text())
            now = witness(blob)
        except (OSError, ValueError):
            return None
        if recorded == now:
            return blob
        self.evict(digest)
        if isinstance(recorded, dict) and set(recorded) != set(WITNESS):  # a record an older draftline wrote
            say(f"the cache's record of {name or digest} predates the change-time witness: evicted it from the "
                "cache; downloading it again (once)")
        else:
            say(f"the cached copy of {name or digest} ({blob}) changed on disk since it was verified (its size, "
                "modification or change time): evicted it from the cache; downloading it again")
        return None

    def evict(self, digest: str) -> None:
        for path in self._paths(digest):
            path.unlink(missing_ok=True)

    def put(self, file: Path, digest: str) -> Path:
        """Move a verified ``file`` into the cache (atomically) and record its witness; return the blob."""
        blob, stat = self._paths(digest)
        blob.parent.mkdir(parents=True, exist_ok=True)
        file.chmod(0o444)
        os.replace(file, blob)
        atomic_write_text(stat, json.dumps(witness(blob)))
        return blob

    def place(self, blob: Path, digest: str, target: Path, name: str) -> None:
        """Copy a blob :meth:`get` returned to ``target``, by the kernel. The witness is read again after the
        copy: a blob changed while it was copied is evicted and the pull refused, naming it."""
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(blob, target)
        if self.get(digest, name) is None:
            target.unlink(missing_ok=True)
            raise VerificationError(f"the cached copy of {name} ({blob}) changed while it was copied: removed it "
                                    "from the cache and refused the pull; pull again to download it afresh")

    def scratch(self) -> tempfile.TemporaryDirectory:
        """A temporary directory on the cache's file system, so ``put`` is a rename. Scratch folders that
        killed pullers left behind are removed first (see :func:`sweep_scratch`)."""
        self.root.mkdir(parents=True, exist_ok=True)
        sweep_scratch(self.root, ".incoming-")
        return tempfile.TemporaryDirectory(prefix=scratch_prefix(".incoming-"), dir=self.root)


STALE_SCRATCH_S = 24 * 3600  # a scratch folder this old is left over, whoever made it


def scratch_prefix(kind: str) -> str:
    """``kind`` + ``<pid>@<host>-``: a folder whose maker can be seen to be gone (:func:`sweep_scratch`)."""
    return f"{kind}{os.getpid()}@{socket.gethostname()}-"


def sweep_scratch(folder: Path, kind: str) -> list[Path]:
    """Remove the scratch folders ``kind*`` in ``folder`` whose maker is gone: made on this host by a process
    that no longer runs (a puller killed with -9 cleans nothing up), or older than a day (made elsewhere: pods
    on one node share a cache but not a process table). Returns what it removed."""
    host, removed = socket.gethostname(), list[Path]()
    try:
        entries = [e for e in folder.iterdir() if e.name.startswith(kind) and e.is_dir()]
    except OSError:
        return removed
    for entry in entries:
        maker = re.fullmatch(rf"{re.escape(kind)}(\d+)@(.+)-[^-]+", entry.name)
        try:
            stale = time.time() - entry.stat().st_mtime > STALE_SCRATCH_S
        except OSError:
            continue
        if maker and maker.group(2) == host and int(maker.group(1)) != os.getpid():
            try:
                os.kill(int(maker.group(1)), 0)
            except ProcessLookupError:
                stale = True
            except OSError:  # alive, someone else's
                pass
        if stale:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed
