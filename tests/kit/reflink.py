"""A file system that clones, for the pull cache's tests and the registry benchmark: XFS with reflink on a loop
device, in a folder of the caller's. Needs root, ``mkfs.xfs`` (Debian's xfsprogs) and a free loop device;
:class:`ReflinkUnavailable` says which one is missing."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path

from tests.kit.loopdisk import loop_mounted


class ReflinkUnavailable(RuntimeError):
    pass


@contextlib.contextmanager
def reflink_mount(folder: Path, size: str = "512M") -> Iterator[Path]:
    """Mount a fresh XFS (``-m reflink=1``) of ``size`` at ``folder/mnt``; unmounted and removed on exit."""
    if shutil.which("mkfs.xfs") is None:
        raise ReflinkUnavailable("mkfs.xfs is not installed (apt-get install xfsprogs)")
    with loop_mounted(folder / "xfs.img", folder / "mnt", size, ("mkfs.xfs", "-q", "-m", "reflink=1"),
                      ReflinkUnavailable) as mnt:
        yield mnt
