"""An installed wheel, outside the checkout, is a draftline that runs: the catalog, the ZeRO configs and the
default policies ship inside it, and nothing reaches back into a source tree."""

import subprocess
import sys
import sysconfig
from pathlib import Path

import mlflow
import pytest
from mlflow import MlflowClient

from draftline import names

from .conftest import clean_env

pytestmark = pytest.mark.integration


def test_the_wheel_installed_elsewhere_runs_finetune_help_plan_and_promote(tmp_path, draftline_wheel):
    # nothing of the checkout may leak in through the environment (PYTHONPATH would satisfy pip, too)
    env = {**clean_env(), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    wheel = draftline_wheel
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, env=env)
    py = venv / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True, env=env)
    # the project's dependencies beside it, as a plain path: the checkout's editable draftline is not seen
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "project-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    def draftline(*args):
        return subprocess.run([str(venv / "bin" / "draftline"), *args], cwd=elsewhere, env=env,
                              capture_output=True, text=True, timeout=300)

    where = subprocess.run([str(py), "-c", "import draftline; print(draftline.__file__)"], cwd=elsewhere, env=env,
                           capture_output=True, text=True)
    assert where.returncode == 0 and where.stdout.startswith(str(venv)), where  # the wheel's copy, not the checkout's

    r = draftline("finetune", "--help")
    assert r.returncode == 0 and "--ds-config" in r.stdout, r.stderr
    r = draftline("plan", "--zero-stage", "2")  # the Kimi-K2 reference shape, 8 GPUs
    assert r.returncode == 0 and "ZeRO-2" in r.stdout, r.stderr

    mlflow.set_tracking_uri(env["MLFLOW_TRACKING_URI"])
    client = MlflowClient()
    client.create_registered_model("d")
    with mlflow.start_run() as run:
        mlflow.log_text("weights", "drafter/model.txt")
    client.create_model_version("d", source=f"{run.info.artifact_uri}/drafter", run_id=run.info.run_id,
                                tags={names.EXPORT_VALIDATED: "true"})
    r = draftline("promote", "d", "1", "--to", "Production", "--dry-run")
    # the policy shipped in the wheel was read: its rules are printed (this bare version fails them)
    assert "train.pairing is vllm-shifted" in r.stdout + r.stderr and "export validated" in r.stdout + r.stderr
    assert "policy file" not in r.stdout + r.stderr  # found, read, valid
    # the GPU deployment's policy set ships in the wheel too, named from any folder
    gpu = draftline("promote", "d", "1", "--to", "Production", "--dry-run", "--policy", "gpu")
    assert "speed-up at concurrency 1 >= 1.05" in gpu.stdout + gpu.stderr, gpu.stdout + gpu.stderr
