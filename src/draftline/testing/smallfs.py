"""A small file system of a given size in a folder of the caller's (a tmpfs mount), for the tests of a disk that
is too small or fills up: the kernel itself then refuses the write (ENOSPC), as a full disk does. Needs root
(or CAP_SYS_ADMIN); :class:`SmallFsUnavailable` says why it cannot be made."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path


class SmallFsUnavailable(RuntimeError):
    pass


@contextlib.contextmanager
def small_filesystem(folder: Path, size_bytes: int) -> Iterator[Path]:
    """Mount a tmpfs of ``size_bytes`` at ``folder``; unmounted on exit. :func:`resize` grows or shrinks it."""
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(folder)],
                          capture_output=True, text=True, check=False)
    if done.returncode:
        raise SmallFsUnavailable(f"mount -t tmpfs failed: {(done.stderr or done.stdout).strip()[:200]}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True, check=False)


def resize(folder: Path, size_bytes: int) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size_bytes}", str(folder)], capture_output=True, check=True)
