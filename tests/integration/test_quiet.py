"""The first hour, as a terminal shows it: prepare -> finetune through the command line, in subprocesses, at the
default verbosity. stderr carries draftline's own lines (the run's link, the plan, progress) and no library
warning or INFO line; stdout is the JSON result."""

import json
import os
import re
import subprocess
import sys

import pytest

from ..conftest import DEMO

pytestmark = pytest.mark.integration
NOISE = re.compile(r"Warning|WARNING|INFO|FutureWarning|Downloading artifacts|Setting accelerator")


def _draftline(cwd, env, *args):
    r = subprocess.run([sys.executable, "-m", "draftline.cli", *map(str, args)], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout), r.stderr


def test_prepare_and_finetune_are_quiet_and_finetune_shows_progress(tiny, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "DRAFTLINE_", "PYTHONWARNINGS",
                                                                   "LOGURU_", "TRANSFORMERS_"))}
    env.update(DRAFTLINE_TINY_DIR=str(tiny["parent"].parent), DRAFTLINE_PROGRESS_S="0")
    prep, prep_err = _draftline(tmp_path, env, "prepare", "--conversations", DEMO, "--verifier", tiny["verifier"],
                                "--max-samples", "16", "--max-length", "128")
    ft, ft_err = _draftline(tmp_path, env, "finetune", "--data", prep["data_uri"], "--init", "tiny", "--gpus", "1",
                            "--steps", "4", "--tokens-per-batch", "256", "--val-every", "4")
    for err in (prep_err, ft_err):
        assert not [ln for ln in err.splitlines() if NOISE.search(ln)], err
    lines = ft_err.splitlines()
    assert lines[0].startswith(f"[draftline] finetune run {ft['run_id']}: http://127.0.0.1:5000/#/experiments/")
    progress = [ln for ln in lines if re.match(r"\[draftline\] step \d+/4  loss [\d.]+  full_acc_0 ", ln)]
    assert len(progress) == 4 and "ETA" in progress[1] and "done in" in progress[-1], ft_err
    assert all(ln.startswith("[draftline] ") for ln in lines), ft_err  # nothing but draftline's own lines
