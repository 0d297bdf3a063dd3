"""One pod's pull for the fleet benchmark, with the HTTP requests it sends counted.

``python -m benchmarks.fleet_puller draftline NAME DEST`` runs ``draftline pull NAME --stage Production --dest
DEST --json``; ``python -m benchmarks.fleet_puller mlflow NAME DEST`` runs what a deployment without draftline
would: ``mlflow.artifacts.download_artifacts("models:/NAME@production", dst_path=DEST)``. Either way the last
line on stderr is ``fleet-requests: {"total": N, "by_path": {...}}``: every request the process sent through
``requests`` (MLflow's only HTTP client), counted at ``Session.send``, so nothing is estimated.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import sys
from collections import Counter
from pathlib import Path

_COUNTS: Counter = Counter()


def _count_requests() -> None:
    import requests

    send = requests.Session.send

    def counted(self, request, **kwargs):
        path = re.sub(r"\?.*", "", request.path_url)
        path = re.sub(r"/artifacts/.*", "/artifacts/<file>", path)  # the proxied download of one file
        _COUNTS[f"{request.method} {path}"] += 1
        if os.environ.get("FLEET_TRACE"):  # where each request comes from, to cut them
            import traceback

            frames = [f for f in traceback.extract_stack()[:-1] if "draftline" in f.filename or "mlflow" in f.filename]
            print(f"REQUEST {request.method} {path}: " + " <- ".join(f"{Path(f.filename).name}:{f.lineno}:{f.name}"
                                                             for f in reversed(frames[-6:])), file=sys.stderr)
        return send(self, request, **kwargs)

    requests.Session.send = counted
    atexit.register(lambda: print("fleet-requests: " + json.dumps({"total": sum(_COUNTS.values()),
                                                                   "by_path": dict(_COUNTS)}),
                                  file=sys.stderr, flush=True))


def main(kind: str, name: str, dest: str) -> None:
    _count_requests()
    if kind == "draftline":
        from draftline.cli import cli

        cli(["pull", name, "--stage", "Production", "--dest", dest, "--json"], prog_name="draftline")
    elif kind == "mlflow":
        import mlflow

        path = mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{name}@production", dst_path=dest)
        print(json.dumps({"path": path}))
    else:
        raise SystemExit(f"unknown puller {kind!r}: draftline or mlflow")


if __name__ == "__main__":
    main(*sys.argv[1:4])
