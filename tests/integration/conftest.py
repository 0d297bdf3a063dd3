"""Fixtures of the integration tier only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The tiny drafter's reference finetune (after --data): test_resume's uninterrupted run and test_nodes' run of one
# node with two ranks, trained once (reference_finetune) at the precision their runs chose
REFERENCE_FINETUNE = ("--init", "tiny", "--gpus", "2", "--steps", "4", "--save-every", "2", "--tokens-per-batch",
                      "512", "--val-fraction", "0")


def clean_env() -> dict[str, str]:
    """This process's environment without the settings that point at a tracking store or at this checkout."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "DRAFTLINE_", "PYTHONPATH"))}


@pytest.fixture(scope="session")
def draftline_wheel(tmp_path_factory) -> Path:
    """draftline's wheel, built once from this checkout."""
    wheels = tmp_path_factory.mktemp("wheels")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(wheels), str(ROOT)], check=True, cwd=wheels, env=clean_env())
    return next(wheels.glob("draftline-*.whl"))


@pytest.fixture(scope="session")
def light_install(tmp_path_factory, draftline_wheel) -> dict[str, Path]:
    """A serving host's install, built once: draftline's wheel (``wheel``) and a fresh venv (``venv``) with
    ``pip install draftline`` alone (MLflow's light client; no torch, DeepSpeed, transformers, speculators).
    Needs the package registry, as ./setup.sh does."""
    env, wheel = clean_env(), draftline_wheel
    venv = tmp_path_factory.mktemp("light-install") / "light"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, env=env)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    str(wheel)], check=True, env=env, timeout=600)
    return {"wheel": wheel, "venv": venv}


@pytest.fixture(scope="session")
def reference_finetune(tiny, prepared, tmp_path_factory):
    """``reference_finetune(precision)``: the consolidated weights of ``finetune --data PREPARED
    REFERENCE_FINETUNE --precision PRECISION``, trained once per precision as the tests ran it (a subprocess in a
    clean working directory with its own tracking store, experiment ``tests``), leaving no DeepSpeed all-reduce
    buffer in /dev/shm. A test passes the precision its own runs logged: ``--precision auto`` measures the host
    each time, and a loaded CPU can choose otherwise from one run to the next."""
    from draftline.drafter.handoff import consolidate

    trained: dict[str, dict] = {}

    def train(precision: str) -> dict:
        if precision not in trained:
            here = tmp_path_factory.mktemp(f"reference-finetune-{precision}")
            env = {**{k: v for k, v in os.environ.items() if k not in (
                       "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID", "DRAFTLINE_TRUST_REMOTE_CODE")},
                   "DRAFTLINE_WORK": str(here / "work"), "DRAFTLINE_TINY_DIR": str(tiny["parent"].parent),
                   "DRAFTLINE_EXPERIMENT": "tests"}
            shm_before = set(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*"))
            done = subprocess.run([sys.executable, "-m", "draftline.cli", "finetune", "--data", str(prepared),
                                   *REFERENCE_FINETUNE, "--precision", precision], capture_output=True, text=True,
                                  cwd=here, env=env)
            assert done.returncode == 0, done.stderr[-3000:]
            assert set(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*")) <= shm_before
            trained[precision] = consolidate(here / "work" / json.loads(done.stdout)["run_id"] / "checkpoints")
        return trained[precision]

    return train
