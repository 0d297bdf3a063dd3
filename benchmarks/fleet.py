"""fleet: N deployments restarting together, each ``draftline pull NAME --stage Production`` in a process of
its own, while Production moves (a promotion or rollback every ``every_s`` seconds), against the README's team
setup: ``mlflow server`` on PostgreSQL with basic-auth and proxied artifacts (two workers), all on this machine.

For 1, 8 and 32 concurrent pullers (half share one cache, as pods on one node; the rest have their own):
pulls/s over the round, p50/p99 latency of one pull (process start to exit: Python and MLflow's import
included, which is most of it at this size), server errors (failed pulls, and retries the pulls logged), and
whether every pulled directory was complete, verified and of a version that held Production during its pull.

Side by side in the same run, each round is repeated with MLflow's own
``mlflow.artifacts.download_artifacts("models:/NAME@production")`` (no checks, no cache: what a deployment
without draftline does), and ``ratio`` gives draftline's p50 and p99 over MLflow's. Every puller counts the
HTTP requests it sends (``benchmarks/fleet_puller.py``); ``requests_per_pull`` is the median, by endpoint.
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


PULLERS = ("draftline", "mlflow")


def run(counts=(1, 8, 32), mib: int = 16, versions: int = 4, every_s: float = 0.5, auth_cache_ttl_s: int = 60,
        pullers=PULLERS) -> dict:
    import mlflow
    from mlflow import MlflowClient
    from mlflow.server import get_app_client

    from draftline.registry.promotion import promote
    from tests.kit import fleet
    from tests.kit.localserver import basic_auth, start_mlflow_server, stop
    from tests.kit.postgres import start_postgres

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
                    for kind in pullers:  # side by side: the same server, data and moving registry
                        rounds.setdefault(kind, {})[str(n)] = r = _round(client, uri, manifests, n,
                                                                         tmp / f"round-{kind}-{n}", every_s, kind)
                        print(f"  {kind:>9} {n:>3} pullers: {r}", flush=True)
            finally:
                stop(proc)
        finally:
            pg.stop()
    return {"shape": "postgres" if auth_cache_ttl_s else "postgres-uncached-auth", "mib_per_version": mib, "versions": versions, "promote_every_s": every_s,
            "server": "mlflow server, PostgreSQL 15, basic-auth, proxied artifacts, 2 workers",
            "auth_cache_ttl_seconds": auth_cache_ttl_s,
            "server_start_s": round(server_start_s, 1), "rounds": rounds,
            "ratio_draftline_over_mlflow": _ratios(rounds),
            "summary": {f"{kind} {n} pullers": f"{r['pulls_per_s']} pulls/s, p50 {r['p50_s']} s, p99 {r['p99_s']} s, "
                        f"{r['requests_per_pull']['total']} requests/pull, {r['server_errors']} server errors, "
                        f"{r['failed']} failed, {r['bad']} bad"
                        for kind, by_n in rounds.items() for n, r in by_n.items()}}


def _ratios(rounds: dict) -> dict:
    if not {"draftline", "mlflow"} <= set(rounds):
        return {}
    out = {}
    for n, ours in rounds["draftline"].items():
        theirs = rounds["mlflow"][n]
        out[f"{n} pullers"] = {q: round(ours[f"{q}_s"] / theirs[f"{q}_s"], 2) for q in ("p50", "p99")} | {
            "requests": f"{ours['requests_per_pull']['total']} vs {theirs['requests_per_pull']['total']}"}
    return out


def _argv(kind: str):
    import sys

    if kind == "draftline":
        return lambda name, dest: [sys.executable, "-m", "benchmarks.fleet_puller", "draftline", name, str(dest)]
    return lambda name, dest: [sys.executable, "-m", "benchmarks.fleet_puller", "mlflow", name, str(dest)]


def _requests(err: str) -> dict:
    import json

    line = next((x for x in reversed(err.splitlines()) if x.startswith("fleet-requests: ")), None)
    return json.loads(line.removeprefix("fleet-requests: ")) if line else {"total": -1, "by_path": {}}


def _version_of(dest: Path, manifests: dict) -> str | None:
    """Which version's files an MLflow-pulled directory holds (it reports no version)."""
    from draftline.util import file_sha256

    model = dest / "model.safetensors"
    digest = file_sha256(model) if model.is_file() else None
    return next((v for v, m in manifests.items() if m["model.safetensors"] == digest), None)


def _round(client, uri: str, manifests: dict, n: int, root: Path, every_s: float, kind: str = "draftline") -> dict:
    from draftline.registry.stages import holders
    from tests.kit import fleet

    first = holders(client, "fleet")["Production"]
    mover = fleet.Mover(client, "fleet", list(manifests), every_s=every_s).start()
    t0 = time.time()
    pulls = fleet.start_pullers(n, "fleet", root, fleet.pull_env(uri, *POD), shared=n // 2, argv=_argv(kind))
    fleet.wait_all(pulls)
    wall = time.time() - t0
    mover.stop()
    lat = [p.seconds for p in pulls]
    failed = [p for p in pulls if p.result() is None]
    bad, pulled = 0, set()
    for p in pulls:
        result = p.result()
        version = result and (result.get("version") or _version_of(p.dest, manifests))
        pulled.add(version) if version else None
        if result and (version is None or (kind == "draftline" and fleet.check_pull(p.dest, version, manifests))
                       or not mover.held_during(first, version, p.started, p.ended)):
            bad += 1
    if kind == "draftline":
        bad += sum(bool(fleet.check_cache(c)) for c in {p.cache for p in pulls})
    counted = [_requests(p.err) for p in pulls]
    totals = sorted(c["total"] for c in counted)
    typical = next(c for c in counted if c["total"] == totals[len(totals) // 2])
    retries = sum(p.err.count("again in") + p.err.count("Retrying (") for p in pulls)
    reasons: dict[str, int] = {}
    for p in failed:  # exit code and the one error line, numbers and ports blurred so that alike ones group
        line = next((x for x in p.err.splitlines() if x.startswith("error: ")), p.err.strip()[-200:])
        key = f"exit {p.proc.returncode}: " + re.sub(r"\d+", "N", line)[:240]
        reasons[key] = reasons.get(key, 0) + 1
    return {"pullers": n, "wall_s": round(wall, 2), "pulls_per_s": round(n / wall, 2),
            "p50_s": round(statistics.median(lat), 2), "p99_s": round(_percentile(lat, 0.99), 2),
            "max_s": round(max(lat), 2), "failed": len(failed),
            "requests_per_pull": {"total": totals[len(totals) // 2], "min": totals[0], "max": totals[-1],
                                  "by_path": typical["by_path"]}, "server_errors": len(failed) + retries,
            "retries_logged": retries, "bad": bad, "registry_changes": len(mover.changes),
            "failures": reasons, "mover_errors": len(mover.errors), "versions_pulled": sorted(pulled)}
