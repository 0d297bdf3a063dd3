"""A real ``mlflow server`` on loopback (proxied artifacts; sqlite by default, or any backend store URI, e.g.
PostgreSQL from :mod:`tests.kit.postgres`) for tests, demos and benchmarks, optionally with MLflow's
basic-auth app."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from draftline.util import free_port


def basic_auth(root: Path, admin: tuple[str, str], database_uri: str | None = None, *,
               auth_cache_ttl_s: int = 60) -> tuple[list[str], dict]:
    """``(extra args, env)`` for ``--app-name basic-auth``: users and permissions in ``database_uri`` (default a
    sqlite file under ``root``), default permission READ, ``admin`` as the admin user. Each server worker keeps
    a checked credential ``auth_cache_ttl_s`` seconds, as the README's team setup recommends (MLflow's
    ``auth_cache_ttl_seconds``; MLflow's default, 0, checks the password hash on every request: ~10x slower, see
    ``benchmarks/server_requests.py``)."""
    root.mkdir(parents=True, exist_ok=True)
    ini, database_uri = root / "auth.ini", database_uri or f"sqlite:///{root / 'auth.db'}"
    ini.write_text(f"[mlflow]\ndefault_permission = READ\ndatabase_uri = {database_uri}\n"
                   f"admin_username = {admin[0]}\nadmin_password = {admin[1]}\n"
                   "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
                   f"auth_cache_ttl_seconds = {int(auth_cache_ttl_s)}\n")
    return ["--app-name", "basic-auth"], {"MLFLOW_AUTH_CONFIG_PATH": str(ini),
                                          "MLFLOW_FLASK_SERVER_SECRET_KEY": "tests-secret-key"}


def start_mlflow_server(root: Path, extra: Sequence[str] = (), env: dict | None = None, timeout_s: float = 120, *,
                        backend_store_uri: str | None = None, port: int | None = None,
                        workers: int = 1) -> tuple[subprocess.Popen, str]:
    """Start ``mlflow server`` with its artifacts (and, by default, a sqlite store) under ``root``; returns
    ``(process, tracking URI)``. Passing the ``port`` and store of a stopped server restarts that server."""
    root.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    uri = f"http://127.0.0.1:{port}"
    log = open(root / "server.log", "ab")  # noqa: SIM115 (the server writes it for its whole life)
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server",
         "--backend-store-uri", backend_store_uri or f"sqlite:///{root / 'mlflow.db'}",
         "--artifacts-destination", str(root / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
         "--workers", str(workers), *extra],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        # no job runner: three more processes per server (MLflow 3's huey consumers) that nothing here uses
        env={"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **os.environ, **(env or {})})
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(uri + "/health", timeout=2).status_code == 200:
                return proc, uri
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError((root / "server.log").read_text()[-3000:])
        time.sleep(0.25)
    os.killpg(proc.pid, signal.SIGKILL)
    raise RuntimeError(f"mlflow server did not start within {timeout_s:.0f} s; see {root / 'server.log'}")


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    """Stop the server and its workers (``SIGKILL``: as a crash would)."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)
