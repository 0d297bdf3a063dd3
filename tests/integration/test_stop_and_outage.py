"""A finetune stopped by SIGTERM/SIGINT saves, ends KILLED and says how to resume; a tracking server that goes
away mid-run stops nothing and gets every metric when it returns; credentials never reach a command line."""

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from draftline import names

pytestmark = pytest.mark.integration


def _draftline(*args):
    return [sys.executable, "-m", "draftline.cli", *map(str, args)]


def _wait_for(predicate, timeout=300, proc=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        if proc is not None and proc.poll() is not None:
            return None
        time.sleep(0.2)
    return None


def _first_metrics():
    return next((p for p in Path("work").glob("*/metrics.jsonl") if p.stat().st_size), None)


def _ranks_of(run_dir: Path) -> list[str]:
    out = subprocess.run(["pgrep", "-f", str(run_dir.resolve() / "worker_spec.json")], capture_output=True,
                         text=True).stdout
    return out.split()


FLAGS = ["--init", "tiny", "--gpus", "2", "--steps", "40", "--save-every", "1000", "--tokens-per-batch", "512",
         "--val-fraction", "0"]


# benchmark tier for "timeout": `timeout -s TERM`'s signal takes the path the process-group case shows in CI
# (1.5 min more, beyond CI's 50-minute budget)
@pytest.mark.parametrize("how", [pytest.param("timeout", marks=pytest.mark.benchmark), "process-group"])
def test_a_signal_saves_a_checkpoint_ends_the_run_killed_and_says_how_to_resume(workspace, prepared, how):
    cmd = _draftline("finetune", "--data", prepared, *FLAGS)
    shm_before = set(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*"))
    if how == "timeout":  # what `timeout -s TERM` does when its time is up: SIGTERM to its command
        proc = subprocess.Popen(["timeout", "-s", "TERM", "1000", *cmd], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
    else:  # Ctrl-C in a terminal: SIGINT to the whole foreground process group
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    metrics = _wait_for(_first_metrics, proc=proc)
    assert metrics is not None, "training never started"
    t0 = time.monotonic()
    if how == "timeout":
        os.kill(proc.pid, signal.SIGTERM)  # timeout relays it to draftline, as when its time runs out
    else:
        os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    stopped_in = time.monotonic() - t0
    run_dir = metrics.parent
    run_id = run_dir.name
    print(f"{how}: stopped and saved in {stopped_in:.1f} s")

    assert proc.returncode == (143 if how == "timeout" else 130), err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "finetune stopped by SIG" in errors[0], err[-3000:]
    assert f"--resume {run_id}" in errors[0]
    assert (run_dir / "checkpoints" / "latest").is_file()
    assert _ranks_of(run_dir) == []  # no rank trains on as an orphan
    assert MlflowClient().get_run(run_id).info.status == "KILLED"
    # DeepSpeed's CPU all-reduce buffers (66 MiB of RAM per rank in /dev/shm, never unlinked): none left behind
    assert set(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*")) <= shm_before

    if how == "timeout":  # the printed command continues the same run to the end
        resume = shlex.split(errors[0].split("resume it with: ", 1)[1])
        assert resume[0] == "draftline"
        done = subprocess.run(_draftline(*resume[1:]), capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
        assert json.loads(done.stdout)["run_id"] == run_id
        run = MlflowClient().get_run(run_id)
        assert run.info.status == "FINISHED"
        steps = {m.step for m in MlflowClient().get_metric_history(run_id, names.TRAIN_LOSS)}
        assert steps == set(range(1, 41))


def test_prepare_stopped_mid_capture_ends_killed_and_its_printed_command_resumes(workspace, tiny):
    """Ctrl-C during the hidden-state capture: exit 130, one line with the command that resumes, the run KILLED,
    the finished shards kept; that command continues the same run to the same data."""
    from ..conftest import DEMO

    cmd = _draftline("prepare", "--conversations", DEMO, "--verifier", tiny["verifier"], "--max-length", "512",
                     "--batch-size", "2", "--shard-tokens", "256", "--output-dir", "prepared")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert _wait_for(lambda: len(list(Path("prepared").glob("shard-*.safetensors"))) >= 2, proc=proc)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "prepare stopped by SIGINT" in errors[0] and "Traceback" not in err, err[-3000:]
    assert "Aborted!" not in err
    [run] = MlflowClient().search_runs([e.experiment_id for e in MlflowClient().search_experiments()])
    assert run.info.status == "KILLED"
    resume = shlex.split(errors[0].split("resume with ", 1)[1])
    done = subprocess.run(_draftline(*resume[1:]), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming the hidden-state capture" in done.stderr
    assert json.loads(done.stdout)["run_id"] == run.info.run_id
    assert MlflowClient().get_run(run.info.run_id).info.status == "FINISHED"


def test_evaluate_stopped_by_sigterm_logs_nothing_and_says_how_to_rerun(workspace, prepared):
    cmd = _draftline("evaluate", "--target", "tiny", "--data", prepared, "--backend", "transformers",
                     "--max-new-tokens", "256")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    seen = []
    for line in proc.stderr:  # inside the measurement
        seen.append(line)
        if "by speculative decoding in this process" in line:
            break
    os.kill(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    err = "".join(seen) + err
    assert proc.returncode == 143, err[-3000:]
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "evaluate stopped by SIGTERM; nothing was logged" in errors[0], err[-3000:]
    assert "draftline evaluate --target tiny" in errors[0]
    runs = MlflowClient().search_runs([e.experiment_id for e in MlflowClient().search_experiments()])
    assert all(r.info.status == "KILLED" for r in runs) and not any(r.data.metrics for r in runs)


@pytest.mark.timeout(900)  # a server stopped and restarted under a finetune: 1.5-3 min, in CI
def test_a_tracking_server_outage_mid_run_loses_no_metric(workspace, prepared, tmp_path, monkeypatch):
    from tests.kit.localserver import start_mlflow_server, stop

    root = tmp_path / "server"
    server, uri = start_mlflow_server(root)
    port = int(uri.rsplit(":", 1)[1])
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}
    steps = 120
    flags = [f if f != "40" else str(steps) for f in FLAGS]
    proc = subprocess.Popen(_draftline("finetune", "--data", prepared, *flags), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        metrics = _wait_for(_first_metrics, proc=proc)
        assert metrics is not None, "training never started"
        stop(server)  # the server goes away mid-run ...
        lines_before = len(metrics.read_text().splitlines())
        time.sleep(10)
        lines_during = len(metrics.read_text().splitlines())
        assert proc.poll() is None, "the outage stopped training"
        server, _ = start_mlflow_server(root, port=port)  # ... and comes back on the same store
        out, err = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if server.poll() is not None:  # still away (the run failed before it came back): back for what follows
            server, _ = start_mlflow_server(root, port=port)
    try:
        print(f"outage: {lines_during - lines_before} metric lines written while the server was away")
        assert lines_during > lines_before  # training went on
        assert proc.returncode == 0, err[-3000:]
        assert "tracking server unreachable" in err and "buffered metrics delivered" in err
        client = MlflowClient(uri)
        run_id = json.loads(out)["run_id"]
        assert client.get_run(run_id).info.status == "FINISHED"
        got = {m.step for m in client.get_metric_history(run_id, names.TRAIN_LOSS)}
        assert got == set(range(1, steps + 1))
    finally:
        stop(server)


def test_multi_node_launch_puts_no_credential_on_a_command_line(tmp_path, monkeypatch):
    """DeepSpeed's runner builds a pdsh command with `export VAR=value;` for every MLFLOW* variable: run it with
    a hostfile of two nodes and record what it would execute (pdsh and ssh replaced by recorders)."""
    from draftline.train.launcher import command, rank_env

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "argv.jsonl"
    for tool in ("pdsh", "ssh"):
        (bin_dir / tool).write_text(f"#!{sys.executable}\nimport json, sys\n"
                                    f"open({str(record)!r}, 'a').write(json.dumps(sys.argv) + '\\n')\n"
                                    "print('127.0.0.1')\n")
        (bin_dir / tool).chmod(0o755)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=1\nnode-b slots=1\n")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.example:5000")
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "alice")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "s3cret-password")
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "s3cret-token")
    env = rank_env(2, on_cpu=True)
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    r = subprocess.run(command(tmp_path / "spec.json", 2, str(hostfile), 29500), env=env, capture_output=True,
                       text=True, timeout=300)
    calls = [json.loads(ln) for ln in record.read_text().splitlines()]
    pdsh = [c for c in calls if Path(c[0]).name == "pdsh"]
    assert pdsh, (r.stdout + r.stderr)[-3000:]
    everything = json.dumps(calls) + r.stdout + r.stderr
    assert "MLFLOW_TRACKING_URI" in json.dumps(pdsh)  # the runner does forward MLFLOW* variables ...
    for secret in ("s3cret-password", "s3cret-token", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN"):
        assert secret not in everything  # ... but none of the credentials


def test_a_corrupt_shard_stops_finetune_with_one_message_naming_it(workspace, prepared, tmp_path):
    import shutil

    data = shutil.copytree(prepared, tmp_path / "data")
    shard = sorted(data.glob("shard-*.safetensors"))[-1]
    raw = bytearray(shard.read_bytes())
    raw[-3] ^= 0xFF  # one byte of hidden state flipped after prepare
    shard.write_bytes(bytes(raw))
    t0 = time.monotonic()
    r = subprocess.run(_draftline("finetune", "--data", data, "--init", "tiny", "--gpus", "2", "--steps", "3",
                                  "--tokens-per-batch", "512", "--val-fraction", "0"), capture_output=True, text=True)
    print(f"corrupt shard refused after {time.monotonic() - t0:.1f} s")
    assert r.returncode == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and f"shard {shard.name} in {data} does not match the sha256" in errors[0], errors
    run = MlflowClient().search_runs([e.experiment_id for e in MlflowClient().search_experiments()])[0]
    assert run.info.status == "FAILED"
