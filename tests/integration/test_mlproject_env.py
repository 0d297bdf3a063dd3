"""`mlflow run .` as the design card writes it: MLflow builds the project's environment from conda.yaml (here with
uv, which reads its pip section as requirements) and runs the entry points in it. The build downloads torch and
its CUDA libraries from PyPI (several GB on a cold cache), so this is the benchmark tier."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

from draftline import names

from ..conftest import DEMO, ROOT

# benchmark tier: `mlflow run` builds its own environment from conda.yaml (torch, DeepSpeed, speculators, MLflow
# downloaded again from the registry), which CI's clean clone cannot afford every time
pytestmark = pytest.mark.benchmark


@pytest.mark.timeout(3600)
def test_mlflow_run_builds_the_environment_with_uv_and_runs_prepare_and_finetune(tiny, tmp_path):
    uv = shutil.which("uv") or str(Path(sys.executable).parent / "uv")
    if not Path(uv).exists():
        pytest.skip("uv is not installed (requirements-dev.txt lists it)")
    env = {**os.environ, "PATH": f"{Path(uv).parent}:{Path(sys.executable).parent}:{os.environ['PATH']}",
           "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}", "DRAFTLINE_TINY_DIR": str(tiny["parent"].parent)}
    env.pop("MLFLOW_RUN_ID", None)

    def mlflow_run(entry: str, *params: str) -> dict:
        args = [sys.executable, "-m", "mlflow", "run", str(ROOT), "-e", entry, "--env-manager", "uv"]
        for p in params:
            args += ["-P", p]
        r = subprocess.run(args, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=3000)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        return json.loads(r.stdout[r.stdout.index("{"):r.stdout.rindex("}") + 1])

    prepared = mlflow_run("prepare", f"conversations={DEMO}", f"verifier={tiny['verifier']}", "max_samples=8",
                          f"output_dir={tmp_path / 'prepared'}")
    trained = mlflow_run("finetune", f"data={prepared['data_uri']}", "init=tiny", "steps=3", "gpus=1")
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    run = client.get_run(trained["run_id"])
    assert run.info.status == "FINISHED" and run.data.params[names.PARENT_NAME] == "tiny"
    # the entry points ran in MLflow's environment, not in this venv
    assert run.data.tags.get("mlflow.project.env") == "uv"
