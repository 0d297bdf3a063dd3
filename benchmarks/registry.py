"""registry: register -> pull of a drafter at the real scale through a local ``mlflow server`` with proxied
artifacts, against MLflow's own ``log_artifacts`` / ``download_artifacts`` of the same bytes.

The drafter is the random real-shape AQ-MedAI checkpoint of ``parent-load`` (~2.3 GB) plus a config, a card and
lineage, i.e. what ``export`` uploads. Sides alternate in one run:

- ``mlflow_upload``: ``mlflow.log_artifacts`` of the directory;
- ``register``: draftline's upload (sha256 of every file computed while MLflow uploads, then ``checksums.json``)
  and the creation of the model version, waiting until it is READY;
- ``mlflow_download``: ``mlflow.artifacts.download_artifacts`` of the uploaded directory;
- ``pull_cold``: ``draftline pull`` as it runs by default, with an empty cache (hashing while the bytes arrive,
  verification included): the download is DEST's file, written once, and the cache keeps its copy only where
  that copy is a clone (:mod:`draftline.registry.blobcache`);
- ``pull_cold_cached``: the same with ``--cache`` (the cache keeps its copy on any file system: on one without
  clones, a second write of every byte);
- ``pull_warm``: the same pull again into another directory (a restarted pod): files come from the cache;
- ``cp``: a local ``cp -r --reflink=never`` of the directory, for scale.

``--on disk`` puts the destinations and the cache in the benchmark's folder (``$BENCH_TMP``, ext4 here);
``--on reflink`` on an XFS with reflink mounted for the run (``tests.kit.reflink``; root and xfsprogs):
the server's store stays on disk either way. The download sides run in a rotating order in every repetition,
and the summary gives each ratio as the median of the per-repetition ratios with their range (side by side in
one repetition, so a machine that slows down between repetitions moves both sides).
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from draftline import names


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _export_dir(root: Path, shape: str) -> Path:
    from benchmarks.common import drafter_config
    from benchmarks.parent_load import write_checkpoint

    d = write_checkpoint(shape, root / "drafter")
    cfg = drafter_config(shape).to_dict()
    cfg["speculators_config"]["verifier"]["name_or_path"] = "moonshotai/Kimi-K2.5"
    (d / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
    (d / "lineage.json").write_text(json.dumps({names.PARENT_SOURCE: "AQ-MedAI/Kimi-K2-Instruct-eagle3"}) + "\n")
    (d / "README.md").write_text("---\nbase_model: AQ-MedAI/Kimi-K2-Instruct-eagle3\n---\n# EAGLE-3 drafter\n")
    return d


def run(shape: str = "real", reps: int = 3, on: str = "disk") -> dict:
    import os

    with tempfile.TemporaryDirectory(prefix="draftline-bench-registry-", dir=os.environ.get("BENCH_TMP")) as tmp:
        if on == "disk":
            return _run(Path(tmp), Path(tmp), shape, reps, on)
        from tests.kit.reflink import reflink_mount

        with reflink_mount(Path(tmp) / "xfs", size="20G") as mnt:
            return _run(Path(tmp), mnt, shape, reps, on)


def _run(tmp: Path, where: Path, shape: str, reps: int, on: str) -> dict:  # noqa: C901  (one side per closure)
    import os

    import mlflow
    from mlflow import MlflowClient

    from draftline.export.upload import CHECKSUMS, upload_with_checksums
    from draftline.registry import versions
    from draftline.registry.blobcache import clones
    from tests.kit.localserver import start_mlflow_server, stop

    times: dict[str, list[float]] = {k: [] for k in
                                     ("mlflow_upload", "register", "mlflow_download", "pull_cold",
                                      "pull_cold_cached", "pull_warm", "cp")}
    src = _export_dir(tmp, shape)
    size = sum(p.stat().st_size for p in src.iterdir())
    proc, uri = start_mlflow_server(tmp / "server")
    saved = {k: os.environ.get(k) for k in ("DRAFTLINE_CACHE_DIR", "HOME")}
    os.environ.pop("DRAFTLINE_CACHE_DIR", None)  # the default cache (~/.cache/draftline), filled by default
    os.environ["HOME"] = str(where / "home")     # only where it clones
    cache = where / "home" / ".cache" / "draftline"
    try:
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment("bench-registry")
        client = MlflowClient()
        for rep in range(reps):
            (src / CHECKSUMS).unlink(missing_ok=True)

            def mlflow_upload():
                with mlflow.start_run() as r:
                    mlflow.log_artifacts(str(src), "drafter")
                return r

            def ours_register():  # as export does: a LoggedModel, checksums last, then the version
                with mlflow.start_run() as r:
                    logged = mlflow.initialize_logged_model(name="bench-drafter", source_run_id=r.info.run_id)
                    upload_with_checksums(src, logged.model_id)
                    mlflow.finalize_logged_model(logged.model_id, "READY")
                    return versions.register(client, "bench-drafter", model_id=logged.model_id,
                                             run_id=r.info.run_id, tags={"bench": "1"}, description="benchmark")

            holder: dict = {}
            first = [("mlflow_upload", mlflow_upload), ("register", ours_register)]
            for name, fn in (first if rep % 2 == 0 else first[::-1]):
                if name == "mlflow_upload":
                    (src / CHECKSUMS).unlink(missing_ok=True)
                t = time.perf_counter()
                holder[name] = fn()
                times[name].append(time.perf_counter() - t)
            base_uri = f"{holder['mlflow_upload'].info.artifact_uri}/drafter"
            version = holder["register"].version

            def pull(dest: str, use_cache):
                return lambda: versions.pull(client, "bench-drafter", stage=None, alias=None, version=str(version),
                                             dest=where / dest, use_cache=use_cache)

            def mlflow_download():
                d = where / "dl-mlflow"
                d.mkdir()
                mlflow.artifacts.download_artifacts(artifact_uri=base_uri, dst_path=str(d))

            def cold_then_warm():  # a restarted pod: the warm pull takes what the --cache pull kept
                times["pull_cold_cached"].append(_timed(pull("dl-cached", True)))
                times["pull_warm"].append(_timed(pull("dl-warm", None)))

            second = [("mlflow_download", mlflow_download), ("pull_cold", pull("dl-cold", None)),
                      ("pull_cold_cached", cold_then_warm)]
            for name, fn in second[rep % 3:] + second[:rep % 3]:
                if name != "mlflow_download":
                    shutil.rmtree(cache, ignore_errors=True)  # every pull side starts cold
                if name == "pull_cold_cached":
                    fn()  # times itself and the warm pull after it
                else:
                    times[name].append(_timed(fn))
            times["cp"].append(_timed(lambda: subprocess.run(
                ["cp", "-r", "--reflink=never", str(src), str(where / "dl-cp")], check=True)))
            for d in ("dl-mlflow", "dl-cold", "dl-cached", "dl-warm", "dl-cp"):
                shutil.rmtree(where / d, ignore_errors=True)
        cache.mkdir(parents=True, exist_ok=True)
        cloning = clones(cache, where)
    finally:
        stop(proc)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    med = {k: statistics.median(v) for k, v in times.items()}

    def ratio(a: str, b: str, digits: int = 3) -> dict:
        per_rep = [x / y for x, y in zip(times[a], times[b], strict=True)]
        return {"median": round(statistics.median(per_rep), digits),
                "range": [round(min(per_rep), digits), round(max(per_rep), digits)]}

    return {
        "shape": shape if on == "disk" else f"{shape}-{on}",
        "destination_file_system": {"on": on, "clones": cloning},
        "bytes": size,
        "reps": reps,
        "seconds": {k: [round(x, 3) for x in v] for k, v in times.items()},
        "summary": {
            "register / mlflow_upload": round(med["register"] / med["mlflow_upload"], 3),
            "pull_cold / mlflow_download": ratio("pull_cold", "mlflow_download"),
            "pull_cold_cached / mlflow_download": ratio("pull_cold_cached", "mlflow_download"),
            "pull_warm / pull_cold": ratio("pull_warm", "pull_cold"),
            "pull_warm / pull_cold_cached": ratio("pull_warm", "pull_cold_cached"),
            "pull_warm / cp": ratio("pull_warm", "cp"),
            "mlflow_download / cp": round(med["mlflow_download"] / med["cp"], 2),
            "mlflow_upload_MBps": round(size / med["mlflow_upload"] / 1e6, 1),
            "mlflow_download_MBps": round(size / med["mlflow_download"] / 1e6, 1),
            "targets": "register <= 1.1x upload; pull_cold <= 1.1x download; pull_warm <= 0.1x pull_cold",
        },
    }
