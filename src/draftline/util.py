"""Small helpers every stage uses, each written once: an atomic write, a file's sha256, a free port, a lock."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shlex
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from draftline.errors import DataError, Interrupted

SIGNALS = (signal.SIGTERM, signal.SIGINT)


def atomic_write_text(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` so that readers see the old file or the new one, never a part: a temporary
    file in the same folder (unique, so concurrent writers do not collide), then a rename over ``path``."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def file_sha256(path: Path) -> str:
    """The sha256 of a file, streamed (``hashlib.file_digest``)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def file_manifest(paths) -> dict[str, str]:
    """``{file name: sha256}`` of the files (what ``checksums.json`` holds)."""
    return {Path(p).name: file_sha256(Path(p)) for p in sorted(Path(x) for x in paths)}


def manifest_digest(manifest: dict[str, str]) -> str:
    """The one digest draftline gives a set of files: sha256 over its sorted ``(name, sha256)`` pairs. An
    export's ``export.sha256``, a parent's ``parent.sha256`` and a pulled directory's ``manifest_sha256``."""
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()


def files_digest(paths) -> str:
    """:func:`manifest_digest` of the files' :func:`file_manifest`."""
    return manifest_digest(file_manifest(paths))


def free_port(span: int = 1) -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, and with ``span`` > 1 the ports after it too
    (a finetune's ``--master-port`` takes the port and the next one)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + span - 1 <= 65535 and all(_free(port + i) for i in range(1, span)):
            return port
    raise OSError(f"no {span} free consecutive TCP ports on 127.0.0.1")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@contextlib.contextmanager
def exclusive(lock_file: Path, *, busy: str):
    """One writer at a time: hold ``lock_file`` (created if needed, an exclusive non-blocking ``flock``) for
    the block; raise :class:`DataError` ``busy`` if another process holds it. The kernel releases it when the
    holder dies, even by ``kill -9``."""
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_file, "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DataError(busy) from None
        yield


def same_command() -> str:
    """The command this process was started with, to run again (``draftline prepare ...``)."""
    return "draftline " + shlex.join(sys.argv[1:]) if sys.argv[1:] else "the same command"


@contextlib.contextmanager
def interrupt_on_signals(message: Callable[[str], str]) -> Iterator[None]:
    """While the block runs, SIGTERM/SIGINT raise :class:`Interrupted` (``message(signal name)``; exit 143/130),
    so the stage's MLflow run ends KILLED and the servers it started stop, instead of the process vanishing with
    its run RUNNING (or click's bare "Aborted!")."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_interrupted(signum, _frame):
        raise Interrupted(message(signal.Signals(signum).name), signum)

    previous = {s: signal.signal(s, raise_interrupted) for s in SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
