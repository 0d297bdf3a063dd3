"""A file system in an image file, loop-mounted as a real disk is mounted: what the small disks
(:mod:`tests.kit.smallfs`) and the cloning XFS (:mod:`tests.kit.reflink`) are made of. Needs root (or
CAP_SYS_ADMIN) and a free loop device; each failure is the caller's own ``error``, naming the command."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path


def run(error: type[Exception], *cmd: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise error(f"{' '.join(cmd)} failed: {(done.stderr or done.stdout).strip()[:200]}")


@contextlib.contextmanager
def loop_mounted(image: Path, mountpoint: Path, size: str, mkfs: Sequence[str],
                 error: type[Exception]) -> Iterator[Path]:
    """``mkfs`` (its command, the image appended) on a fresh ``image`` of ``size``, mounted at ``mountpoint``;
    unmounted and the image removed on exit (and when it cannot be made)."""
    mountpoint.mkdir(parents=True, exist_ok=True)
    run(error, "truncate", "-s", size, str(image))
    try:
        run(error, *mkfs, str(image))
        run(error, "mount", "-o", "loop", str(image), str(mountpoint))
    except error:
        image.unlink(missing_ok=True)
        raise
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True, check=False)
        image.unlink(missing_ok=True)
