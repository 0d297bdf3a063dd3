"""A throwaway PostgreSQL cluster on loopback (Debian's ``postgresql`` server) for tests and benchmarks.

``initdb`` and ``pg_ctl`` refuse to run as root, and CI runs as root: then the cluster belongs to an
unprivileged account (``postgres``, which Debian's package creates; else ``nobody``), and its data directory is
a fresh folder under the system's temporary directory that account owns. The superuser ``mlflow`` logs in over
TCP on 127.0.0.1 with a password (scram-sha-256), as a team's server would; durability is switched off
(``fsync``, ``synchronous_commit``, ``full_page_writes``): a test cluster lives for one session.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftline.util import free_port

USER, PASSWORD = "mlflow", "mlflow-password-for-tests-1"
_UNPRIVILEGED = ("postgres", "nobody")


class PostgresUnavailable(RuntimeError):
    """No PostgreSQL server binaries here (or no unprivileged account to run them as root)."""


def pg_bin() -> Path:
    """The folder of ``initdb``/``pg_ctl``: ``$PG_BIN``, else where ``initdb`` on PATH points, else the newest
    ``/usr/lib/postgresql/*/bin`` (Debian keeps the server binaries off PATH)."""
    found = os.environ.get("PG_BIN") or shutil.which("initdb")
    if found:
        path = Path(found)
        folder = path if path.is_dir() else path.resolve().parent
        if (folder / "pg_ctl").exists():
            return folder
    for candidate in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(Path(p).parent.name),
                            reverse=True):
        if Path(candidate, "initdb").exists():
            return Path(candidate)
    raise PostgresUnavailable("no PostgreSQL server here (initdb, pg_ctl): install Debian's `postgresql` "
                              "(apt-get install -y postgresql) or set PG_BIN to the folder holding initdb")


def _account() -> pwd.struct_passwd | None:
    """The account the cluster runs as: ``None`` (ourselves) unless we are root."""
    if os.geteuid() != 0:
        return None
    for name in _UNPRIVILEGED:
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    raise PostgresUnavailable("running as root and no unprivileged account (postgres, nobody) to run "
                              "PostgreSQL as")


@dataclass
class Postgres:
    """A running cluster: ``uri(db)`` names a database on it (SQLAlchemy form, psycopg2 driver: MLflow 3.17's
    registry fails on psycopg 3, whose typed binds PostgreSQL refuses to compare with the integer version
    column, e.g. in ``transition_model_version_stage(..., archive_existing_versions=True)``)."""

    data: Path
    port: int
    bin: Path
    account: pwd.struct_passwd | None

    def uri(self, database: str) -> str:
        return f"postgresql+psycopg2://{USER}:{PASSWORD}@127.0.0.1:{self.port}/{database}"

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        kw: dict[str, Any] = ({"user": self.account.pw_uid, "group": self.account.pw_gid, "extra_groups": []}
                              if self.account else {})
        return subprocess.run([str(self.bin / args[0]), *args[1:]], capture_output=True, text=True,
                              timeout=timeout, check=False, cwd=self.data.parent, **kw)

    def create_database(self, name: str) -> str:
        """Create database ``name`` (owned by ``mlflow``) and return its URI."""
        import psycopg2  # noqa: PLC0415 (optional: psycopg2, the postgres extra)

        conn = psycopg2.connect(host="127.0.0.1", port=self.port, user=USER, password=PASSWORD, dbname="postgres")
        try:
            conn.autocommit = True
            with conn.cursor() as cur:
                cur.execute(f'CREATE DATABASE "{name}"')
        finally:
            conn.close()
        return self.uri(name)

    def stop(self) -> None:
        self.run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop", timeout=60)
        shutil.rmtree(self.data.parent, ignore_errors=True)


def start_postgres(timeout_s: float = 120) -> Postgres:
    """``initdb`` a new cluster in a temporary folder and ``pg_ctl start`` it on a free loopback port."""
    binaries, account = pg_bin(), _account()
    home = Path(tempfile.mkdtemp(prefix="draftline-pg-"))
    data, pwfile = home / "data", home / "pwfile"
    pwfile.write_text(PASSWORD + "\n")
    if account:
        os.chown(home, account.pw_uid, account.pw_gid)
        os.chown(pwfile, account.pw_uid, account.pw_gid)
    pg = Postgres(data=data, port=free_port(), bin=binaries, account=account)
    r = pg.run("initdb", "-D", str(data), "-U", USER, f"--pwfile={pwfile}", "--auth-host=scram-sha-256",
                "--auth-local=scram-sha-256", "-E", "UTF8", "--locale=C", "--no-sync")
    if r.returncode != 0:
        shutil.rmtree(home, ignore_errors=True)
        raise PostgresUnavailable(f"initdb failed: {(r.stderr or r.stdout)[-2000:]}")
    options = (f"-p {pg.port} -c listen_addresses=127.0.0.1 -k {home} -c fsync=off -c synchronous_commit=off "
               "-c full_page_writes=off -c max_connections=200")
    r = pg.run("pg_ctl", "-D", str(data), "-l", str(home / "server.log"), "-o", options, "-w",
                "-t", str(int(timeout_s)), "start", timeout=timeout_s + 10)
    if r.returncode != 0:
        log = (home / "server.log").read_text()[-2000:] if (home / "server.log").exists() else ""
        shutil.rmtree(home, ignore_errors=True)
        raise PostgresUnavailable(f"pg_ctl start failed: {r.stderr or r.stdout}{log}")
    deadline = time.monotonic() + timeout_s
    while pg.run("pg_isready", "-h", "127.0.0.1", "-p", str(pg.port)).returncode != 0:
        if time.monotonic() > deadline:
            pg.stop()
            raise PostgresUnavailable(f"PostgreSQL on port {pg.port} did not accept connections")
        time.sleep(0.2)
    return pg
