"""Two launchers on loopback as two nodes of one job (one CPU rank each, gloo): one MLflow run, the drafter of
a one-node two-rank run; nodes that disagree are refused before any run exists."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from draftline import names
from draftline.util import free_port

from .conftest import REFERENCE_FINETUNE

pytestmark = pytest.mark.integration


def _node(flags, rank, port, *extra, env=None):
    return subprocess.Popen([sys.executable, "-m", "draftline.cli", "finetune", *map(str, flags), "--gpus", "1",
                             "--nnodes", "2", "--node-rank", str(rank), "--master-addr", "127.0.0.1",
                             "--master-port", str(port), *map(str, extra)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, **(env or {})})


def _runs():
    client = MlflowClient()
    exp = client.get_experiment_by_name("tests")
    return client.search_runs([exp.experiment_id]) if exp else []


@pytest.mark.timeout(1800)  # generous: a slow CPU (no AMX, bf16 or fp32) trains these 4 steps in ~2 min
def test_two_nodes_train_the_drafter_of_one_node_with_two_ranks(workspace, prepared, reference_finetune):
    from draftline.drafter.handoff import consolidate

    flags = ["--data", prepared, "--init", "tiny", "--steps", "4", "--save-every", "2", "--tokens-per-batch", "512",
             "--val-fraction", "0"]
    port = free_port(2)
    # a node that disagrees is told before anything trains; a bounded rendezvous keeps a lost answer from hanging
    disagree = [_node(flags, 1, port, "--steps", "5", "--rendezvous-timeout", "120"),
                _node(flags, 0, port, "--rendezvous-timeout", "120")]
    outs = [p.communicate(timeout=600) for p in disagree]
    assert [p.returncode for p in disagree] != [0, 0]
    assert "steps (4 on node 0, 5 on node 1)" in outs[0][1] and "steps (4 on node 0, 5 on node 1)" in outs[1][1]
    assert "Traceback" not in outs[0][1] + outs[1][1] and _runs() == []  # nothing opened

    port = free_port(2)
    nodes = [_node(flags, 1, port), _node(flags, 0, port)]
    (out1, err1), (out0, err0) = (p.communicate(timeout=900) for p in nodes)
    assert nodes[1].returncode == 0, err0[-3000:]
    assert nodes[0].returncode == 0, err1[-3000:]
    run_id = json.loads(out0)["run_id"]
    assert json.loads(out1)["run_id"] == run_id and len(_runs()) == 1  # node 1 attached, logged nothing
    assert MlflowClient().get_run(run_id).data.params["world_size"] == "2"

    # the same job on one node with two ranks (`finetune *flags --gpus 2`), at the precision the two nodes chose:
    # reference_finetune trained it
    options = lambda args: dict(zip(args[::2], map(str, args[1::2]), strict=True))  # noqa: E731
    assert options([*flags, "--gpus", "2"]) == options(["--data", prepared, *REFERENCE_FINETUNE])
    two_nodes = consolidate(Path("work") / run_id / "checkpoints")
    one_node = reference_finetune(MlflowClient().get_run(run_id).data.params[names.TRAIN_PRECISION])
    assert two_nodes.keys() == one_node.keys()
    for key in one_node:
        torch.testing.assert_close(two_nodes[key], one_node[key], rtol=1e-3, atol=1e-5, msg=key)


def test_a_node_whose_master_does_not_answer_says_so(workspace, prepared):
    node = _node(["--data", prepared, "--init", "tiny", "--steps", "2"], 1, free_port(2), "--rendezvous-timeout", "2")
    _, err = node.communicate(timeout=120)
    assert node.returncode != 0 and "node 0 did not answer" in err and "Traceback" not in err


@pytest.mark.timeout(1800)  # generous: two nodes, a kill and a resume on a slow CPU
def test_a_node_lost_mid_training_stops_every_node_and_the_job_resumes_across_nodes(workspace, prepared):
    """kill -9 of node 1's whole process group at its first checkpoint: node 0 ends its ranks and the run FAILED
    with the resume line; both nodes rerun with --resume and finish the same run, its steps continued. (Enough steps
    that a fast CPU, 6 steps a second in bf16 with AMX, is still training when the kill lands.)"""
    steps = 40
    flags = ["--data", prepared, "--init", "tiny", "--steps", str(steps), "--save-every", "2", "--tokens-per-batch",
             "512", "--val-fraction", "0"]
    fast = {"DRAFTLINE_NODE_STALE_S": "5"}
    port = free_port(2)
    one, zero = _node(flags, 1, port, env=fast), _node(flags, 0, port, env=fast)
    deadline, latest = time.monotonic() + 400, None
    while time.monotonic() < deadline and latest is None and zero.poll() is None:
        latest = next(Path("work").glob("*/checkpoints/latest"), None)
        time.sleep(0.1)
    assert latest is not None, "no checkpoint before the job ended"
    os.killpg(one.pid, signal.SIGKILL)
    one.wait()
    _, err0 = zero.communicate(timeout=300)
    assert zero.returncode != 0 and "Traceback" not in err0, err0[-3000:]
    errors = [ln for ln in err0.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "node 1" in errors[0] and "--resume" in errors[0], err0[-3000:]
    (run,) = _runs()
    assert run.info.status == "FAILED"
    assert not [p for p in _children() if p != os.getpid()], "a rank was left running"

    port = free_port(2)
    resumed = [_node(flags, 1, port, "--resume", run.info.run_id), _node(flags, 0, port, "--resume", run.info.run_id)]
    (_, e1), (out0, e0) = (p.communicate(timeout=600) for p in resumed)
    assert [p.returncode for p in resumed] == [0, 0], (e0[-2000:], e1[-2000:])
    assert json.loads(out0)["run_id"] == run.info.run_id and len(_runs()) == 1
    client = MlflowClient()
    assert client.get_run(run.info.run_id).info.status == "FINISHED"
    logged = sorted({m.step for m in client.get_metric_history(run.info.run_id, names.TRAIN_LOSS)})
    assert logged == list(range(1, steps + 1)), logged


def _children() -> list[int]:
    """This test's ranks still alive: draftline.train.worker processes working in this test's folder."""
    out, here = [], os.getcwd()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if b"draftline.train.worker" in (d / "cmdline").read_bytes() and os.readlink(d / "cwd") == here:
                    out.append(int(d.name))
            except OSError:
                continue
    return out
