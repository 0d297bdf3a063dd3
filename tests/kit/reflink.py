"""A file system that clones, for the pull cache's tests and the registry benchmark: XFS with reflink on a loop
device, in a folder of the caller's. Needs root, ``mkfs.xfs`` (Debian's xfsprogs) and a free loop device;
:class:`ReflinkUnavailable` says which one is missing."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path


class ReflinkUnavailable(RuntimeError):
    pass


def _run(*cmd: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise ReflinkUnavailable(f"{' '.join(cmd)} failed: {(done.stderr or done.stdout).strip()[:200]}")


@contextlib.contextmanager
def reflink_mount(folder: Path, size: str = "512M") -> Iterator[Path]:
    """Mount a fresh XFS (``-m reflink=1``) of ``size`` at ``folder/mnt``; unmounted and removed on exit."""
    if shutil.which("mkfs.xfs") is None:
        raise ReflinkUnavailable("mkfs.xfs is not installed (apt-get install xfsprogs)")
    image, mnt = folder / "xfs.img", folder / "mnt"
    mnt.mkdir(parents=True, exist_ok=True)
    _run("truncate", "-s", size, str(image))
    try:
        _run("mkfs.xfs", "-q", "-m", "reflink=1", str(image))
        _run("mount", "-o", "loop", str(image), str(mnt))
    except ReflinkUnavailable:
        image.unlink(missing_ok=True)
        raise
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, check=False)
        image.unlink(missing_ok=True)
