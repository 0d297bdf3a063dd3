"""A real ``mlflow server`` on loopback (sqlite backend, proxied artifacts) for tests, demos and benchmarks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from draftline.util import free_port


def start_mlflow_server(root: Path, extra: list[str] = (), env: dict | None = None,
                        timeout_s: float = 120, port: int | None = None) -> tuple[subprocess.Popen, str]:
    """Start ``mlflow server`` storing everything under ``root`` (on ``port``, else a free one; the same root and
    port restart the same server); returns ``(process, tracking URI)``."""
    import httpx

    root.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    uri = f"http://127.0.0.1:{port}"
    log = open(root / "server.log", "wb")  # noqa: SIM115 (the server writes it for its whole life)
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
         "--artifacts-destination", str(root / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1", *extra],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **(env or {})})
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(uri + "/health", timeout=2).status_code == 200:
                return proc, uri
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError((root / "server.log").read_text()[-3000:])
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    raise RuntimeError(f"mlflow server did not start within {timeout_s:.0f} s; see {root / 'server.log'}")


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=30)
