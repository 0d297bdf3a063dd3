"""A finetune killed mid-run (kill -9 of the whole process group) continues in the same MLflow run."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

pytestmark = pytest.mark.integration


def _draftline(*args):
    return [sys.executable, "-m", "draftline.cli", *map(str, args)]


def test_kill_and_resume_continues_the_same_run(workspace, prepared):
    flags = ["--data", prepared, "--init", "tiny", "--gpus", "2", "--steps", "6", "--save-every", "2",
             "--tokens-per-batch", "512", "--val-fraction", "0"]
    proc = subprocess.Popen(_draftline("finetune", *flags), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 300
    latest = None
    while time.monotonic() < deadline and proc.poll() is None:
        found = list(Path("work").glob("*/checkpoints/latest"))
        if found and found[0].read_text().strip() in ("step2", "step4"):
            latest = found[0]
            break
        time.sleep(0.2)
    assert latest is not None, "no checkpoint appeared before the run ended"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    run_id = latest.parents[1].name
    client = MlflowClient()
    params_before = client.get_run(run_id).data.params

    changed = subprocess.run(_draftline("finetune", *flags[:-2], "--val-fraction", "0.2", "--resume", run_id),
                             capture_output=True, text=True)
    assert changed.returncode == 1
    assert "cannot change its settings" in changed.stderr and "Traceback" not in changed.stderr

    done = subprocess.run(_draftline("finetune", *flags, "--resume", run_id), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["run_id"] == run_id
    assert "resumed from" in done.stderr
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params == params_before
    steps = sorted({m.step for m in client.get_metric_history(run_id, "train/loss")})
    assert steps == [1, 2, 3, 4, 5, 6]
