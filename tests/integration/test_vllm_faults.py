"""Real vLLM killed (SIGKILL, as the OOM killer or a lost node does) in the middle of the work draftline gives it:
the answers and shards already made are kept, one line names the dead server, and the rerun against a
restarted server asks only for what is missing and ends where an uninterrupted run ends. Skipped, saying
why, without the vLLM venv (CI builds it and requires it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from ..conftest import ROOT

pytestmark = pytest.mark.integration
PROMPTS = ROOT / "configs" / "demo" / "gsm8k_train_prompts.jsonl"


def draftline(*args: str, env: dict, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "draftline.cli", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=900)


def in_process(*args: str, env: dict):
    """``draftline ARGS`` in this process (its working directory, ``workspace``), with what ``env`` sets beyond
    this process's environment; the experiment MLflow exports on the way is not left to what follows."""
    from click.testing import CliRunner

    from draftline.cli import cli

    changed = {k: v for k, v in env.items() if os.environ.get(k) != v}
    return CliRunner().invoke(cli, list(args), env={"MLFLOW_EXPERIMENT_ID": None, **changed},
                              catch_exceptions=False)


def successes(endpoint: str) -> float:
    """Requests vLLM finished, from its Prometheus counters."""
    text = httpx.get(endpoint.removesuffix("/v1") + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total"))


def kill_when(condition, pid_of, timeout_s: float = 600.0) -> threading.Thread:
    """SIGKILL the process group ``pid_of()`` names once ``condition()`` holds."""
    def watch():
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if condition():
                pid = pid_of()
                if pid:
                    os.killpg(pid, signal.SIGKILL)
                return
            time.sleep(0.05)
    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


@pytest.fixture()
def env(workspace, vllm_python, tmp_path):
    e = {**os.environ, "DRAFTLINE_CACHE_DIR": str(tmp_path / "cache"), "MLFLOW_TRACKING_URI":
         f"sqlite:///{workspace / 'mlflow.db'}", "PYTHONUNBUFFERED": "1"}
    return e


@pytest.mark.timeout(1200)
def test_vllm_killed_mid_regeneration_keeps_the_answers_and_the_rerun_asks_only_for_the_rest(env, tiny, workspace,
                                                                                           tmp_path):
    from draftline.serving.engine import ServeSpec, VllmServer

    verifier = str(tiny["verifier"])
    args = ("prepare", "--conversations", str(PROMPTS), "--max-samples", "24", "--verifier", verifier,
            "--regenerate-max-tokens", "48", "--regenerate-concurrency", "2", "--max-length", "256")
    partials = lambda: list((tmp_path / "cache").rglob("*.partial"))  # noqa: E731
    answered = lambda: sum(len(p.read_text().splitlines()) for p in partials())  # noqa: E731
    with VllmServer(ServeSpec(model=verifier, served_name="tiny", max_model_len=1024)) as server:
        killer = kill_when(lambda: answered() >= 6, lambda: server.proc.pid)
        r = draftline(*args, "--regenerate-endpoint", server.endpoint, env=env, cwd=workspace)
        killer.join()
    assert r.returncode == 1, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "stopped answering after" in errors[0] and "Traceback" not in r.stderr, r.stderr
    kept = answered()
    assert 6 <= kept < 24 and f"after {kept} of 24" in errors[0]

    with VllmServer(ServeSpec(model=verifier, served_name="tiny", max_model_len=1024)) as again:
        r = draftline(*args, "--regenerate-endpoint", again.endpoint, env=env, cwd=workspace)
        assert r.returncode == 0, r.stderr
        asked = successes(again.endpoint)
        # an uninterrupted run on the same server, into another cache: what the resumed one must equal
        whole = in_process(*args, "--regenerate-endpoint", again.endpoint, "--output-dir", str(tmp_path / "whole"),
                           env={**env, "DRAFTLINE_CACHE_DIR": str(tmp_path / "cache2")})
        assert whole.exit_code == 0, whole.output
    assert asked == (24 - kept) + 1  # the missing conversations, and prepare's one probe before it opened a run
    resumed = json.loads(r.stdout)["location"]
    one = json.loads((Path(resumed) / "manifest.json").read_text())
    two = json.loads((tmp_path / "whole" / "manifest.json").read_text())
    assert one["regenerated"]["reused"] == kept and one["regenerated"]["done"] == 24 - kept
    assert [s["sha256"] for s in one["shards"]] == [s["sha256"] for s in two["shards"]]


@pytest.mark.timeout(1200)
def test_vllm_killed_mid_capture_keeps_the_shards_and_the_rerun_resumes_after_them(env, tiny, workspace, tmp_path):
    verifier = str(tiny["verifier"])
    args = ("prepare", "--conversations", str(ROOT / "configs" / "demo" / "conversations.jsonl"), "--verifier",
            verifier, "--max-samples", "48", "--max-length", "256", "--batch-size", "4", "--shard-tokens", "64",
            "--capture-backend", "vllm")
    out = tmp_path / "shards"
    shards = lambda: list(out.glob("shard-*.safetensors"))  # noqa: E731

    def capture_server() -> int | None:
        for p in psutil.process_iter(["pid", "cmdline"]):
            if "draftline_hs_connector" in " ".join(p.info["cmdline"] or []):
                return os.getpgid(p.info["pid"])
        return None

    killer = kill_when(lambda: len(shards()) >= 2, capture_server)
    r = draftline(*args, "--output-dir", str(out), env=env, cwd=workspace)
    killer.join()
    assert r.returncode == 1, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "died" in errors[0] and "Traceback" not in r.stderr, r.stderr
    kept = len(shards())
    assert kept >= 2

    r = draftline(*args, "--output-dir", str(out), env=env, cwd=workspace)
    assert r.returncode == 0, r.stderr
    assert f"after {kept} finished shards" in r.stderr
    whole = in_process(*args, "--output-dir", str(tmp_path / "whole"), env=env)
    assert whole.exit_code == 0, whole.output
    one = json.loads((out / "manifest.json").read_text())
    two = json.loads((tmp_path / "whole" / "manifest.json").read_text())
    assert [s["sha256"] for s in one["shards"]] == [s["sha256"] for s in two["shards"]]


def test_a_server_that_lists_models_but_cannot_answer_leaves_no_run_and_no_folder(workspace, tiny, tmp_path):
    """Nothing is opened for a dead-on-arrival endpoint: prepare's one real request fails first."""
    from click.testing import CliRunner
    from mlflow import MlflowClient

    from draftline.cli import cli
    from tests.kit.tiny_server import serve_in_thread

    with serve_in_thread(tiny["verifier"], fail_after=0) as srv:  # lists its model, answers 503 to every request
        r = CliRunner().invoke(cli, ["prepare", "--conversations", str(PROMPTS), "--max-samples", "4",
                                     "--verifier", str(tiny["verifier"]), "--regenerate-endpoint", srv.url])
    assert r.exit_code == 1 and "answered a test request with HTTP 503" in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1
    assert MlflowClient().search_runs([e.experiment_id for e in MlflowClient().search_experiments()]) == []
    assert not (workspace / "work" / "prepared").exists()
