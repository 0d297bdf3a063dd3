"""Room on disk: free space checked before a long write (:func:`require_free`), and running out of room while
writing, as the OS (or a library's message) reports it, turned into one clear error naming the file and the fix."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile
from pathlib import Path

from draftline.errors import DiskFullError

# Running out of room, as the OS reports it.
ROOM_ERRNOS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
               errno.EFBIG: "file too large"}


_ERRNO_IN_TEXT = re.compile(r"\[Errno (\d+)\]|\(os error (\d+)\)")  # Python's OSError; Rust's io::Error


_FAILED_FILE = re.compile(r"^##### File (.+) #####$", re.M)  # MLflow's report of a failed artifact download


def out_of_room(exc: BaseException | None) -> tuple[int, str | None] | None:
    """``(errno, file or None)`` when ``exc``, or an exception behind it, is ENOSPC, EDQUOT or EFBIG.

    Not every library re-raises the OSError: safetensors reports it as text ("File too large (os error 27)"),
    MLflow's artifact download as a text block per failed file, and draftline's own wrappers raise
    ``from None`` (the original stays in ``__context__``); so the chain is walked and the messages read.
    """
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in ROOM_ERRNOS:
            return exc.errno, exc.filename if isinstance(exc.filename, str) else None
        text = str(exc)
        codes = [int(a or b) for a, b in _ERRNO_IN_TEXT.findall(text)]
        codes += [c for c in ROOM_ERRNOS if os.strerror(c) in text]
        code = next((c for c in codes if c in ROOM_ERRNOS), None)
        if code is not None:
            failed = _FAILED_FILE.search(text)
            return code, failed.group(1) if failed else None
        exc = exc.__cause__ or exc.__context__
    return None


@contextlib.contextmanager
def room_for(target: Path | str, *, space_fix: str, size_fix: str):
    """Turn running out of room while writing ``target`` into one :class:`DiskFullError` that names the file
    and the fix; any other error passes through unchanged."""
    try:
        yield
    except Exception as e:  # noqa: BLE001
        found = out_of_room(e)
        if found is None:
            raise
        code, name = found
        path = name if name and os.path.isabs(name) else f"{target}/{name}" if name else str(target)
        if code == errno.EFBIG:
            raise DiskFullError(f"file too large while writing {path} (over the file size limit, `ulimit -f`, "
                                f"or the largest file its file system takes): {size_fix}") from None
        raise DiskFullError(f"{ROOM_ERRNOS[code]} while writing {path}: {space_fix}") from None


def in_tmp(target: Path):
    where = tempfile.gettempdir()
    return room_for(target, space_fix=f"free space on {where} or point TMPDIR elsewhere",
                    size_fix="raise the limit or point TMPDIR elsewhere")


def in_store(target: str):
    return room_for(target, space_fix=f"free space on the artifact store ({target}) and on "
                    f"{tempfile.gettempdir()}, then export again",
                    size_fix="raise the limit, then export again")


def free_bytes(path: Path | str) -> int:
    """Free bytes on the file system that holds ``path``, or would hold it (its nearest existing folder)."""
    p = Path(path).expanduser().absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def require_free(path: Path | str, need: int, *, what: str, fix: str) -> int:
    """Raise :class:`DiskFullError` (one line) when the file system of ``path`` has less than ``need`` bytes free;
    returns what it has."""
    free = free_bytes(path)
    if free < need:
        raise DiskFullError(f"{what} needs {human_bytes(need)} and the file system of {path} has "
                            f"{human_bytes(free)} free: {fix}")
    return free


def human_bytes(n: float) -> str:
    """``n`` bytes in the largest decimal unit under which it is at least 1 (1.2 TB, 57.3 KB)."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"
