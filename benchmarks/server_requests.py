"""server-requests: what one registry request and one artifact download cost on each tracking-server setup.

The fleet benchmark's pulls were slow on the team setup (PostgreSQL + basic-auth) and racing promotions took
5x longer there than on the plain sqlite server. This separates the suspects, measured side by side in one run
on the same machine, each server with two workers as the team setup runs:

- ``sqlite`` / ``postgres``: the store alone, no auth;
- ``sqlite+auth`` / ``postgres+auth``: MLflow's basic-auth app as it ships (``auth_cache_ttl_seconds = 0``: every
  request checks the password hash);
- ``postgres+auth+cache``: the same with ``auth_cache_ttl_seconds = 60`` (each worker keeps a checked
  credential for a minute).

For each: the median latency of ``get_registered_model`` sent one at a time, requests/s with 8 client threads,
and the seconds to download a 16 MiB artifact through the proxied artifact store; all as a non-admin user
(``pod``, READ by default), as a deployment pulls. ``hash_check_ms`` is one ``check_password_hash`` of a hash
as MLflow stores it, in this process: the floor each uncached request pays.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

ADMIN = ("admin", "admin-password-for-bench-1")
POD = ("pod", "pod-password-for-bench-1")
CONFIGS = ("sqlite", "sqlite+auth", "postgres", "postgres+auth", "postgres+auth+cache")


def _hash_check_ms(n: int = 5) -> float:
    from werkzeug.security import check_password_hash, generate_password_hash

    stored = generate_password_hash(POD[1])  # what MLflow's auth store keeps (werkzeug's default method)
    t = time.perf_counter()
    for _ in range(n):
        assert check_password_hash(stored, POD[1])
    return round((time.perf_counter() - t) / n * 1000, 1)


def _measure(uri: str, user: tuple[str, str] | None, artifact: str, sequential: int, threads: int,
             per_thread: int) -> dict:
    from mlflow import MlflowClient

    auth = {"MLFLOW_TRACKING_USERNAME": user[0], "MLFLOW_TRACKING_PASSWORD": user[1]} if user else {}
    os.environ.update(auth)
    try:
        client = MlflowClient(uri)
        client.get_registered_model("bench")  # warm: connection, worker imports
        lat = []
        for _ in range(sequential):
            t = time.perf_counter()
            client.get_registered_model("bench")
            lat.append(time.perf_counter() - t)
        errors = []

        def worker():
            c = MlflowClient(uri)
            for _ in range(per_thread):
                try:
                    c.get_registered_model("bench")
                except Exception as e:  # noqa: BLE001 (counted, reported)
                    errors.append(repr(e)[:200])

        t = time.perf_counter()
        pool = [threading.Thread(target=worker) for _ in range(threads)]
        for th in pool:
            th.start()
        for th in pool:
            th.join()
        concurrent_s = time.perf_counter() - t
        with tempfile.TemporaryDirectory() as dst:
            t = time.perf_counter()
            import mlflow

            mlflow.artifacts.download_artifacts(artifact_uri=artifact, dst_path=dst, tracking_uri=uri)
            download_s = time.perf_counter() - t
    finally:
        for k in auth:
            os.environ.pop(k, None)
    return {"request_p50_ms": round(statistics.median(lat) * 1000, 1),
            "request_p90_ms": round(sorted(lat)[int(0.9 * (len(lat) - 1))] * 1000, 1),
            f"requests_per_s_{threads}_threads": round(threads * per_thread / concurrent_s, 1),
            "errors": len(errors), "download_16mib_s": round(download_s, 2)}


def _one(config: str, tmp: Path, pg, sequential: int, threads: int, per_thread: int) -> dict:
    import mlflow
    from mlflow import MlflowClient
    from mlflow.server import get_app_client

    from tests.kit.localserver import basic_auth, start_mlflow_server, stop

    root = tmp / config.replace("+", "-")
    store = pg.create_database(f"mlflow_{config.replace('+', '_')}") if config.startswith("postgres") else None
    extra, env, user = [], {}, None
    if "+auth" in config:
        auth_db = pg.create_database(f"auth_{config.replace('+', '_')}") if store else None
        extra, env = basic_auth(root, ADMIN, auth_db, auth_cache_ttl_s=60 if config.endswith("+cache") else 0)
        user = POD
    t = time.perf_counter()
    proc, uri = start_mlflow_server(root, extra, env, backend_store_uri=store, workers=2, timeout_s=600)
    start_s = time.perf_counter() - t
    try:
        admin = {"MLFLOW_TRACKING_USERNAME": ADMIN[0], "MLFLOW_TRACKING_PASSWORD": ADMIN[1]} if user else {}
        os.environ.update(admin)
        try:
            if user:
                get_app_client("basic-auth", tracking_uri=uri).create_user(*POD)
            client = MlflowClient(uri)
            client.create_registered_model("bench")
            mlflow.set_tracking_uri(uri)
            exp = client.create_experiment("bench")
            blob = root / "blob"
            blob.mkdir()
            (blob / "weights.bin").write_bytes(os.urandom(16 << 20))
            with mlflow.start_run(experiment_id=exp) as run:
                mlflow.log_artifacts(str(blob), "drafter")
            artifact = f"runs:/{run.info.run_id}/drafter"
        finally:
            for k in admin:
                os.environ.pop(k, None)
        result = _measure(uri, user, artifact, sequential, threads, per_thread)
    finally:
        stop(proc)
    return {"server_start_s": round(start_s, 1), **result}


def run(sequential: int = 40, threads: int = 8, per_thread: int = 10) -> dict:
    from tests.kit.postgres import start_postgres

    results = {}
    with tempfile.TemporaryDirectory(prefix="draftline-bench-requests-", dir=os.environ.get("BENCH_TMP")) as tmp:
        pg = start_postgres()
        try:
            for config in CONFIGS:
                results[config] = _one(config, Path(tmp), pg, sequential, threads, per_thread)
                print(f"  {config:<20} {results[config]}", flush=True)
        finally:
            pg.stop()
    base = results["sqlite"]["request_p50_ms"]
    return {"shape": "loopback", "server": "mlflow server, 2 workers, proxied artifacts; PostgreSQL 15 on loopback",
            "hash_check_ms": _hash_check_ms(), "sequential_requests": sequential, "threads": threads,
            "configs": results,
            "summary": {c: f"{r['request_p50_ms']} ms a request ({r['request_p50_ms'] / base:.1f}x sqlite), "
                           f"{r[f'requests_per_s_{threads}_threads']} req/s at {threads} threads, "
                           f"16 MiB in {r['download_16mib_s']} s" for c, r in results.items()}}
