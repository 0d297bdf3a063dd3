"""One writer at a time: an exclusive, non-blocking ``flock`` on a lock file."""

from __future__ import annotations

import contextlib
import fcntl
from pathlib import Path

from draftline.errors import DataError


@contextlib.contextmanager
def exclusive(lock_file: Path, *, busy: str):
    """Hold ``lock_file`` (created if needed) for the block; raise :class:`DataError` ``busy`` if another
    process holds it. The kernel releases it when the holder dies, even by ``kill -9``."""
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_file, "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DataError(busy) from None
        yield
