"""Serve what a registry stage names: pull the version, start the deployment's own vLLM on it, and follow the stage.

``draftline serve NAME --stage Production`` pulls and verifies the version (as ``pull``), then runs the host's
``vllm serve`` for the verifier with the ``--speculative-config`` the version records, the host's own vLLM flags
passed through after ``--``. draftline never imports vLLM: it starts it as a process and forwards SIGTERM/SIGINT to
it, and exits with vLLM's status. With ``--follow-minutes N`` it asks the registry every N minutes which version
the stage (or alias) names; when another one (a promotion, or a rollback), it pulls and verifies it beside the
one serving, stops vLLM (SIGTERM, then ``--stop-timeout`` seconds) and starts it on the new one. A pull that fails,
or a registry that does not answer, leaves the serving version serving and is said; it is retried at the next
check. Every switch is recorded on both versions as tags: ``served.<host>.since`` and ``served.<host>.until``,
and ``DEST/serving`` points at the version vLLM runs (``observe --drafter DEST/serving`` follows it).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from draftline import environment, names
from draftline.errors import ConfigError, DraftlineError, VerificationError

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@dataclass
class Version:
    """A pulled version ready to serve."""

    number: str
    directory: Path
    spec: dict
    verifier: str
    trust_remote_code: bool
    dtype: str | None


@dataclass
class Stop:
    """Set by SIGTERM/SIGINT: the signal to forward to vLLM, then to end on."""

    signum: int | None = None
    handlers: dict = field(default_factory=dict)

    def install(self) -> None:
        for s in STOP_SIGNALS:
            self.handlers[s] = signal.signal(s, self._set)

    def restore(self) -> None:
        for s, h in self.handlers.items():
            signal.signal(s, h)

    def _set(self, signum, _frame) -> None:
        self.signum = signum


def launcher(vllm: str | None) -> list[str]:
    """The command that starts the deployment's vLLM server: ``--vllm`` as given (e.g. ``vllm serve``, or
    ``/opt/vllm/bin/python -m vllm.entrypoints.openai.api_server``), else ``vllm serve`` where ``vllm`` is on the
    PATH, else the Python of ``$DRAFTLINE_VLLM_PYTHON``'s venv with vLLM's OpenAI server module."""
    if vllm:
        prefix = shlex.split(vllm)
        if not shutil.which(prefix[0]):
            raise ConfigError(f"--vllm {vllm!r}: {prefix[0]} is not an executable here; pass the command that "
                              "starts your vLLM (e.g. 'vllm serve' or '/opt/vllm/bin/python -m "
                              "vllm.entrypoints.openai.api_server')")
        return prefix
    found = shutil.which("vllm")
    if found:
        return [found, "serve"]
    python = environment.VLLM_PYTHON.get()
    if python and python != "off" and Path(python).is_file():
        return [python, "-m", "vllm.entrypoints.openai.api_server"]
    raise ConfigError("no vLLM here: no `vllm` on the PATH and no DRAFTLINE_VLLM_PYTHON; pass --vllm with the "
                      "command that starts your vLLM server")


def argv(prefix: list[str], v: Version, passthrough: list[str]) -> list[str]:
    """The vLLM command for version ``v``: the verifier, the version's speculative config, the dtype and custom-code
    flags its lineage asks for, then the host's own flags (which win where they repeat one)."""
    cmd = [*prefix, "--model", v.verifier, "--speculative-config", json.dumps(v.spec)]
    if v.trust_remote_code and "--trust-remote-code" not in passthrough:
        cmd.append("--trust-remote-code")
    if v.dtype and "--dtype" not in passthrough:
        cmd += ["--dtype", v.dtype]
    return cmd + list(passthrough)


def check_verifier(given: str, identity: str | None, tags: dict, version: str, say: Callable[[str], None]) -> None:
    """Refuse a version trained for another verifier than the host's (``given``, known as ``identity`` where its
    files or name say which model it is); where nothing says, serve it and say so."""
    trained = tags.get(names.VERIFIER_NAME_OR_PATH)
    if not trained or identity == trained or given == trained:
        return
    if identity is None:
        say(f"{given} does not say which model it is (no repo id in its config.json or path); serving {version}, "
            f"trained for {trained}, on it as given")
        return
    raise VerificationError(f"{version} was trained for verifier {trained}, and this host serves {identity} "
                            f"({given}); nothing was downloaded: serve a version trained for {identity}, or pass "
                            "the right --verifier")


def host_name() -> str:
    return environment.HOST.get() or socket.gethostname()


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Server:
    """One vLLM process, in a process group of its own (its engine processes stop with it)."""

    def __init__(self, cmd: list[str], log: Path | None = None):
        self.cmd = cmd
        out = open(log, "ab") if log else None  # noqa: SIM115 (kept open while vLLM runs)
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT if out else
                                     None, start_new_session=True)

    def signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signum)

    def stop(self, timeout_s: float) -> int:
        """SIGTERM (vLLM's server stops taking requests and shuts its engine down), then SIGKILL after
        ``timeout_s``; returns its exit status."""
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.proc.wait()
        with contextlib.suppress(ProcessLookupError):  # what it left in its group
            os.killpg(self.proc.pid, signal.SIGKILL)
        return self.proc.returncode


@dataclass
class Follow:
    """What serving needs from the registry, injected so the loop is the same in tests and on a host: the
    version the stage names now (``current``), a pull of it (``pull``), and the record of a switch (``record``)."""

    current: Callable[[], str]
    pull: Callable[[str], Version]
    record: Callable[[str, str, str], None]  # (version, "since" | "until", when)


def serve(follow: Follow, prefix: list[str], passthrough: list[str], *, every_s: float | None, stop_timeout_s: float,
          say: Callable[[str], None], log: Path | None = None, stop: Stop | None = None) -> int:
    """Serve the version the stage names until vLLM exits or a signal arrives (then vLLM's status, or 128 +
    the signal); with ``every_s``, switch to the version the stage names at each check."""
    stop = stop or Stop()
    serving = follow.pull(follow.current())
    server = _start(prefix, serving, passthrough, follow, say, log)
    stop.install()
    try:
        next_check = time.monotonic() + every_s if every_s else None
        while True:
            if stop.signum is not None:
                say(f"{signal.Signals(stop.signum).name}: stopping vLLM (version {serving.number})")
                server.stop(stop_timeout_s)
                follow.record(serving.number, "until", now())
                return 128 + stop.signum
            code = server.proc.poll()
            if code is not None:
                follow.record(serving.number, "until", now())
                say(f"vLLM exited with status {code} (version {serving.number})")
                return code
            if next_check is not None and time.monotonic() >= next_check:
                next_check = time.monotonic() + (every_s or 0)
                moved = _check(follow, serving, say)
                if moved is not None:
                    say(f"switching from version {serving.number} to {moved.number}: stopping vLLM")
                    server.stop(stop_timeout_s)
                    follow.record(serving.number, "until", now())
                    serving, server = moved, _start(prefix, moved, passthrough, follow, say, log)
            time.sleep(0.2)
    finally:
        stop.restore()
        if server.proc.poll() is None:  # an exception on the way: never leave vLLM running unattended
            server.stop(stop_timeout_s)


def _start(prefix: list[str], v: Version, passthrough: list[str], follow: Follow, say, log: Path | None) -> Server:
    cmd = argv(prefix, v, passthrough)
    say(f"serving version {v.number}: {shlex.join(cmd)}")
    try:
        server = Server(cmd, log)
    except OSError as e:
        raise DraftlineError(f"cannot start vLLM ({e.strerror}: {cmd[0]}): pass --vllm with the command that "
                             "starts your vLLM server") from None
    point_serving(v.directory)
    follow.record(v.number, "since", now())
    return server


SERVING_LINK = "serving"  # DEST/serving: the version vLLM runs now (observe --drafter DEST/serving follows it)


def point_serving(directory: Path) -> None:
    """Point ``DEST/serving`` at ``directory`` (``DEST/v<N>``) in one rename, so a reader sees the old version or
    the new one, never none."""
    link, tmp = directory.parent / SERVING_LINK, directory.parent / f".{SERVING_LINK}.{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    tmp.symlink_to(directory.name)
    os.replace(tmp, link)


def _check(follow: Follow, serving: Version, say) -> Version | None:
    """The version to switch to, or None: the same one, or a registry or a pull that failed (said; serving goes
    on and the next check tries again)."""
    try:
        wanted = follow.current()
    except Exception as e:  # noqa: BLE001 (whatever the registry answers, the serving version keeps serving)
        say(f"the registry did not say which version to serve ({_line(e)}); version {serving.number} keeps serving")
        return None
    if wanted == serving.number:
        return None
    try:
        return follow.pull(wanted)
    except Exception as e:  # noqa: BLE001 (a pull that fails, verification included, changes nothing served)
        say(f"version {wanted} could not be pulled ({_line(e)}); version {serving.number} keeps serving")
        return None


def _line(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__
