"""A small disk of a given size in a folder of the caller's, for the tests of a disk that is too small or fills
up: an ext4 file system in an image file, loop-mounted as a real disk is mounted, so the kernel itself refuses
the write (ENOSPC) and ``statvfs`` reports what a real disk reports. Needs root (or CAP_SYS_ADMIN), a free loop
device and ``mkfs.ext4`` (Debian's e2fsprogs); :class:`SmallFsUnavailable` says which one is missing.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

from tests.kit.loopdisk import loop_mounted, run


class SmallFsUnavailable(RuntimeError):
    pass


def _run(*cmd: str) -> None:
    run(SmallFsUnavailable, *cmd)


def _image(folder: Path) -> Path:
    return folder.parent / f".{folder.name}.ext4"


@contextlib.contextmanager
def small_filesystem(folder: Path, size_bytes: int) -> Iterator[Path]:
    """Mount an ext4 of ``size_bytes`` (no journal, no reserved blocks) at ``folder``; unmounted and its image
    removed on exit. :func:`resize` grows it."""
    if shutil.which("mkfs.ext4") is None:
        raise SmallFsUnavailable("mkfs.ext4 is not installed (apt-get install e2fsprogs)")
    with loop_mounted(_image(folder), folder, str(size_bytes), ("mkfs.ext4", "-q", "-F", "-m", "0", "-O",
                                                               "^has_journal"), SmallFsUnavailable) as mounted:
        yield mounted


def resize(folder: Path, size_bytes: int) -> None:
    """Grow the disk at ``folder`` to ``size_bytes``, its files kept: unmounted, the image and the file system
    grown, mounted again (a container may refuse ext4's on-line resize)."""
    image = _image(folder)
    _run("umount", str(folder))
    _run("truncate", "-s", str(size_bytes), str(image))
    subprocess.run(["e2fsck", "-fy", str(image)], capture_output=True, check=False)  # resize2fs asks for it
    _run("resize2fs", str(image))
    _run("mount", "-o", "loop", str(image), str(folder))
