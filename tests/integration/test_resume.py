"""A finetune or a prepare killed mid-run (kill -9 of the whole process group) continues in the same MLflow run."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from mlflow import MlflowClient

from draftline import names
from draftline.cli import cli

from .conftest import REFERENCE_FINETUNE

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def _draftline(*args):
    return [sys.executable, "-m", "draftline.cli", *map(str, args)]


def _in_process(*args):
    """``draftline ARGS`` in this process, where a subprocess would only start Python again; the experiment
    MLflow exports on the way is not left to what follows."""
    return CliRunner().invoke(cli, [*map(str, args)], env={"MLFLOW_EXPERIMENT_ID": None}, catch_exceptions=False)


def _killed_at_step2(flags: list) -> str:
    """Start a finetune, kill -9 its whole process group once step 2 is checkpointed; the run's id."""
    proc = subprocess.Popen(_draftline("finetune", *flags), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 300
    latest = None
    while time.monotonic() < deadline and proc.poll() is None:
        found = list(Path("work").glob("*/checkpoints/latest"))
        if found and found[0].read_text().strip() == "step2":
            latest = found[0]
            break
        time.sleep(0.2)
    assert latest is not None, "no checkpoint appeared before the run ended"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return latest.parents[1].name


def _resumed_equals_uninterrupted(flags: list, run_id: str, params_before: dict, reference: dict | None = None) -> dict:
    """Resume the killed run to the end; its weights are those of an uninterrupted run with the same seed
    (``reference``: its consolidated weights, where a fixture trained it; otherwise it is trained here)."""
    from draftline.drafter.handoff import consolidate

    client = MlflowClient()
    done = subprocess.run(_draftline("finetune", *flags, "--resume", run_id), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["run_id"] == run_id
    assert "resumed from" in done.stderr
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params == params_before
    steps = sorted({m.step for m in client.get_metric_history(run_id, names.TRAIN_LOSS)})
    assert steps == [1, 2, 3, 4]

    if reference is None:
        straight = subprocess.run(_draftline("finetune", *flags), capture_output=True, text=True)
        assert straight.returncode == 0, straight.stderr[-3000:]
        reference = consolidate(Path("work") / json.loads(straight.stdout)["run_id"] / "checkpoints")
    resumed = consolidate(Path("work") / run_id / "checkpoints")
    assert resumed.keys() == reference.keys()
    for key in reference:
        torch.testing.assert_close(resumed[key], reference[key], rtol=1e-2, atol=1e-3, msg=key)  # bf16 tolerance
    identical = sum(torch.equal(resumed[k], reference[k]) for k in reference)
    print(f"resumed vs uninterrupted: {identical}/{len(reference)} tensors bit-identical")
    return run.data.params


@pytest.mark.timeout(900)
def test_kill_and_resume_continues_the_same_run(workspace, prepared, reference_finetune):
    flags = ["--data", prepared, *REFERENCE_FINETUNE]  # the uninterrupted run: reference_finetune
    shm_before = set(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*"))
    run_id = _killed_at_step2(flags)
    params_before = MlflowClient().get_run(run_id).data.params

    assert flags[-2:] == ["--val-fraction", "0"]
    changed = _in_process("finetune", *flags[:-2], "--val-fraction", "0.2", "--resume", run_id)
    assert changed.exit_code == 1
    assert "cannot change its settings" in changed.stderr and "Traceback" not in changed.stderr

    _resumed_equals_uninterrupted(flags, run_id, params_before,
                                  reference_finetune(params_before[names.TRAIN_PRECISION]))
    # DeepSpeed's CPU all-reduce buffers (66 MiB of RAM per rank in /dev/shm): none left by the three runs, the
    # one killed with -9 included (the uninterrupted one's fixture checks its own)
    assert set(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*")) <= shm_before


@pytest.fixture(scope="module")
def kimi_prepared(kimi, tmp_path_factory) -> Path:
    """The demo conversations captured from the Kimi-shaped verifier (custom code, transformers capture)."""
    from draftline.config import PrepareConfig
    from draftline.data.prepare import build_data
    from draftline.serving.hf_model import allow_custom_code

    allow_custom_code(kimi["verifier"])  # what --trust-remote-code tells prepare
    out = tmp_path_factory.mktemp("kimi-prepared") / "data"
    build_data(PrepareConfig(conversations=str(ROOT / "configs" / "demo" / "conversations.jsonl"),
                             verifier=str(kimi["verifier"]), trust_remote_code=True, max_length=256,
                             shard_tokens=4096), out, progress=False)
    return out


@pytest.mark.timeout(900)
def test_an_mla_drafter_under_zero3_from_its_whole_vocabulary_parent_resumes_as_uninterrupted(
        workspace, kimi, kimi_prepared, monkeypatch):
    """The mission's drafter in miniature: MLA layer, ZeRO-3 (parameters partitioned over the ranks), --vocab
    parent from a parent whose draft vocabulary is the verifier's whole vocabulary (no d2t/t2d), killed at step 2
    and resumed to the weights an uninterrupted run reaches."""
    monkeypatch.setenv("DRAFTLINE_TINY_KIMI_DIR", str(kimi["parent_mla"].parent))
    flags = ["--data", kimi_prepared, "--init", "tiny-kimi-mla", "--vocab", "parent", "--gpus", "2",
             "--zero-stage", "3", "--steps", "4", "--save-every", "2", "--tokens-per-batch", "512",
             "--val-fraction", "0"]
    run_id = _killed_at_step2(flags)
    params = _resumed_equals_uninterrupted(flags, run_id, MlflowClient().get_run(run_id).data.params)
    whole = json.loads((kimi["verifier"] / "config.json").read_text())["vocab_size"]
    assert params[names.DRAFTER_LAYER] == "mla" and params[names.ZERO_STAGE] == "3" and params[names.VOCAB_POLICY] == "parent"
    assert params[names.VOCAB_DRAFT_SIZE] == str(whole) and params[names.VOCAB_DROPPED] == "0", params


def test_prepare_killed_during_capture_resumes_in_the_same_run_and_writes_the_same_data(workspace, tiny, prepared):
    from draftline.data.shards import PROGRESS, open_prepared

    out = workspace / "data"
    flags = ["--conversations", ROOT / "configs" / "demo" / "conversations.jsonl", "--verifier", tiny["verifier"],
             "--max-length", "256", "--shard-tokens", "4096", "--output-dir", out]
    proc = subprocess.Popen(_draftline("prepare", *flags), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None and not (out / PROGRESS).is_file():
        time.sleep(0.05)
    assert proc.poll() is None, "prepare ended before its first shard could be interrupted"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    finished = len(json.loads((out / PROGRESS).read_text())["shards"])
    assert 1 <= finished < len(open_prepared(prepared).manifest["shards"])
    killed = MlflowClient().search_runs(["0"] + [e.experiment_id for e in MlflowClient().search_experiments()])
    assert [r.info.status for r in killed] == ["RUNNING"]  # what kill -9 leaves behind

    done = subprocess.run(_draftline("prepare", *flags), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"after {finished} finished shards" in done.stderr
    result = json.loads(done.stdout)
    assert result["run_id"] == killed[0].info.run_id  # the same MLflow run, now FINISHED
    assert MlflowClient().get_run(result["run_id"]).info.status == "FINISHED"
    # byte for byte what an uninterrupted prepare of the same inputs wrote
    assert result["digest"] == open_prepared(prepared).manifest["digest"]
