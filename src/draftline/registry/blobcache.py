"""The content-addressed cache pulls share: one read-only file per sha256, trusted by what the kernel says of it.

A blob enters the cache only after its bytes were hashed (a download verified as it arrived, see
:mod:`draftline.registry.transfer`). With it the cache records the blob's *witness*: size, modification time,
inode and change time (``st_ctime``). Every write, truncation, ``chmod``, ``touch`` or replacement of the file
moves its change time, and no user call sets it back (``utime`` restores mtime, never ctime), so a blob whose
witness is unchanged holds the bytes that were hashed, and a warm pull copies it without reading it twice. A
blob whose witness changed is evicted, saying so in one line, and downloaded again. What a witness cannot see is
a write that also turns back the system clock, or one made to the block device under the file system: ``pull
--verify-only DIR`` re-hashes a pulled directory for those who must rule that out.

Blobs are copied in and out with :func:`clone_or_copy`, never a hard link: no destination shares an inode with
the cache or another destination, so a pulled file edited in place changes nothing else. Where the file system
clones (XFS with reflink, btrfs, bcachefs, ZFS 2.2+), a copy is a clone: copy-on-write extents, no bytes
written, so the cache costs a pull nothing. Where it does not (ext4), the cache's copy is a second write of
every byte a cold pull downloads, which pays only on a node that pulls the same bytes again. So the cache
*fills* (keeps what a pull downloaded) where it clones into the destination's file system, or where it was
asked for (``$DRAFTLINE_CACHE_DIR`` set, or ``pull --cache``); it is *read* wherever it holds a digest.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import socket
import tempfile
import time
from pathlib import Path

from draftline import environment
from draftline.config import cache_root
from draftline.console import say
from draftline.errors import VerificationError
from draftline.util import atomic_write_text

WITNESS = ("size", "mtime_ns", "ctime_ns", "ino")
FICLONE = 0x40049409  # linux/fs.h: _IOW(0x94, 9, int), the file systems' common clone call


def _clone(src: Path, dst: Path) -> None:
    """``dst`` a clone of ``src`` (shared extents, copy-on-write: a later write to either changes only that
    one); OSError (EOPNOTSUPP, EXDEV, EINVAL) where the file system makes none, or none across these two."""
    with open(src, "rb") as s, open(dst, "wb") as d:
        fcntl.ioctl(d.fileno(), FICLONE, s.fileno())


def clone_or_copy(src: Path, dst: Path) -> bool:
    """Copy ``src`` to ``dst`` as a clone where the file system makes one, else by the kernel's copy. True when
    it cloned."""
    try:
        _clone(src, dst)
        return True
    except OSError:
        shutil.copyfile(src, dst)
        return False


def clones(src_dir: Path, dst_dir: Path) -> bool:
    """Whether a file in ``src_dir`` clones into ``dst_dir`` (one byte, tried)."""
    with contextlib.suppress(OSError), tempfile.TemporaryDirectory(dir=src_dir, prefix=".clone-probe-") as a, \
            tempfile.TemporaryDirectory(dir=dst_dir, prefix=".clone-probe-") as b:
        (Path(a) / "x").write_bytes(b"x")
        _clone(Path(a) / "x", Path(b) / "x")
        return True
    return False


def witness(path: Path) -> dict[str, int]:
    """What the kernel says of ``path`` that any change to its bytes, mode or times moves."""
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "ino": st.st_ino}


class BlobCache:
    """One read-only file per sha256 under ``$DRAFTLINE_CACHE_DIR/blobs/sha256`` (default ``~/.cache/draftline``);
    a hit costs one clone or kernel copy (:meth:`place`). ``fill``: keep what pulls download (True), never
    (False), or, by default, where it pays (:meth:`fills`)."""

    def __init__(self, root: Path | None = None, *, fill: bool | None = None):
        self.root = (root or cache_root()) / "blobs" / "sha256"
        self.fill = fill

    def fills(self, dest_dir: Path) -> bool:
        """Whether a pull into ``dest_dir`` keeps its downloads here: as asked, else where the cache clones into
        ``dest_dir``'s file system (its copy is free) or ``$DRAFTLINE_CACHE_DIR`` names the cache (a node's
        operator set one up: its pulls repeat)."""
        if self.fill is None:
            self.root.mkdir(parents=True, exist_ok=True)
            self.fill = environment.CACHE_DIR.is_set() or clones(self.root, dest_dir)
        return self.fill

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
        """Copy a blob :meth:`get` returned to ``target`` (:func:`clone_or_copy`). The witness is read again after the
        copy: a blob changed while it was copied is evicted and the pull refused, naming it."""
        target.parent.mkdir(parents=True, exist_ok=True)
        clone_or_copy(blob, target)
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
