"""fleet: N deployments restarting together, each ``draftline pull NAME --stage Production`` in a process of
its own, while Production moves (a promotion or rollback every ``every_s`` seconds), against the README's team
setup: ``mlflow server`` on PostgreSQL with basic-auth and proxied artifacts (two workers), all on this machine.

For 1, 8 and 32 concurrent pullers (half share one cache, as pods on one node; the rest have their own):
pulls/s over the round, p50/p99 latency of one pull (process start to exit: Python and MLflow's import
included, which is most of it at this size), server errors (failed pulls, and retries the pulls logged), and
whether every pulled directory was complete, verified and of a version that held Production during its pull.
"""

from __future__ import annotations

import os
import re
import statistics
import tempfile
import time
from pathlib import Path

ADMIN = ("admin", "admin-password-for-bench-1")
POD = ("pod", "pod-password-for-bench-1")


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def run(counts=(1, 8, 32), mib: int = 16, versions: int = 4, every_s: float = 0.5, auth_cache_ttl_s: int = 60) -> dict:
    import mlflow
    from mlflow import MlflowClient
    from mlflow.server import get_app_client

    from draftline.promotion import promote
    from draftline.testing import fleet
    from draftline.testing.localserver import basic_auth, start_mlflow_server, stop
    from draftline.testing.postgres import start_postgres

    rounds = {}
    with tempfile.TemporaryDirectory(prefix="draftline-bench-fleet-", dir=os.environ.get("BENCH_TMP")) as tmp:
        tmp = Path(tmp)
        # integrity rules only: the versions are bytes nobody evaluated (the pulls, not the gates, are measured)
        policies = tmp / "policies"
        policies.mkdir()
        for stage in ("Production", "Staging"):
            (policies / f"{stage.lower()}.yaml").write_text(f"stage: {stage}\nexport_validated: false\n")
        os.environ["DRAFTLINE_REGISTRY_POLICIES"] = str(policies)
        pg = start_postgres()
        try:
            extra, env = basic_auth(tmp / "server", ADMIN, pg.create_database("mlflow_auth"),
                                    auth_cache_ttl_s=auth_cache_ttl_s)
            t = time.perf_counter()
            proc, uri = start_mlflow_server(tmp / "server", extra, env, backend_store_uri=pg.create_database("mlflow"),
                                            workers=2, timeout_s=600)
            server_start_s = time.perf_counter() - t
            try:
                os.environ.update(MLFLOW_TRACKING_URI=uri, MLFLOW_TRACKING_USERNAME=ADMIN[0],
                                  MLFLOW_TRACKING_PASSWORD=ADMIN[1])
                mlflow.set_tracking_uri(uri)
                mlflow.set_experiment("bench-fleet")
                get_app_client("basic-auth", tracking_uri=uri).create_user(*POD)
                client = MlflowClient()
                manifests = fleet.publish(client, "fleet", versions, mib, tmp / "exports")
                promote(client, "fleet", "1", "Production")
                for n in counts:
                    rounds[str(n)] = _round(client, uri, manifests, n, tmp / f"round-{n}", every_s)
                    print(f"  {n:>3} pullers: {rounds[str(n)]}", flush=True)
            finally:
                stop(proc)
        finally:
            pg.stop()
    return {"shape": "postgres" if auth_cache_ttl_s else "postgres-uncached-auth", "mib_per_version": mib, "versions": versions, "promote_every_s": every_s,
            "server": "mlflow server, PostgreSQL 15, basic-auth, proxied artifacts, 2 workers",
            "auth_cache_ttl_seconds": auth_cache_ttl_s,
            "server_start_s": round(server_start_s, 1), "rounds": rounds,
            "summary": {f"{n} pullers": f"{r['pulls_per_s']} pulls/s, p50 {r['p50_s']} s, p99 {r['p99_s']} s, "
                        f"{r['server_errors']} server errors, {r['failed']} failed, {r['bad']} bad"
                        for n, r in rounds.items()}}


def _round(client, uri: str, manifests: dict, n: int, root: Path, every_s: float) -> dict:
    from draftline.promotion import holders
    from draftline.testing import fleet

    first = holders(client, "fleet")["Production"]
    mover = fleet.Mover(client, "fleet", list(manifests), every_s=every_s).start()
    t0 = time.time()
    pulls = fleet.start_pullers(n, "fleet", root, fleet.pull_env(uri, *POD), shared=n // 2)
    fleet.wait_all(pulls)
    wall = time.time() - t0
    mover.stop()
    lat = [p.seconds for p in pulls]
    failed = [p for p in pulls if p.result() is None]
    bad = 0
    for p in pulls:
        result = p.result()
        if result and (fleet.check_pull(p.dest, result["version"], manifests)
                       or not mover.held_during(first, result["version"], p.started, p.ended)):
            bad += 1
    bad += sum(bool(fleet.check_cache(c)) for c in {p.cache for p in pulls})
    retries = sum(p.err.count("again in") + p.err.count("Retrying (") for p in pulls)
    reasons: dict[str, int] = {}
    for p in failed:  # exit code and the one error line, numbers and ports blurred so that alike ones group
        line = next((x for x in p.err.splitlines() if x.startswith("error: ")), p.err.strip()[-200:])
        key = f"exit {p.proc.returncode}: " + re.sub(r"\d+", "N", line)[:240]
        reasons[key] = reasons.get(key, 0) + 1
    return {"pullers": n, "wall_s": round(wall, 2), "pulls_per_s": round(n / wall, 2),
            "p50_s": round(statistics.median(lat), 2), "p99_s": round(_percentile(lat, 0.99), 2),
            "max_s": round(max(lat), 2), "failed": len(failed), "server_errors": len(failed) + retries,
            "retries_logged": retries, "bad": bad, "registry_changes": len(mover.changes),
            "failures": reasons, "mover_errors": len(mover.errors), "versions_pulled": sorted({p.result()["version"] for p in pulls
                                                                          if p.result()})}
