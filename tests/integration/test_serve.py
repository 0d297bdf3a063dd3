"""`draftline serve` on real vLLM: the tiny verifier served with the drafter Production names, a promotion followed
to the new version and a rollback back, each switch recorded on the versions, SIGTERM forwarded and vLLM's status
returned. Skipped, saying why, without the vLLM venv (CI builds it and requires it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner
from mlflow import MlflowClient

from draftline.cli import cli
from draftline.serving.client import read_counters
from draftline.util import free_port

pytestmark = pytest.mark.integration


def invoke(*args):
    r = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout) if r.stdout.lstrip().startswith("{") else r.output


def _drafting(endpoint: str, log: Path, deadline_s: float = 600) -> None:
    """Wait for vLLM at ``endpoint`` to answer, then ask it for a reply and check that it drafted."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            if httpx.get(endpoint.rsplit("/v1", 1)[0] + "/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(1)
    else:
        pytest.fail(f"vLLM did not come up: {log.read_text()[-3000:]}")
    r = httpx.post(endpoint + "/chat/completions", timeout=120, json={
        "model": "tiny", "messages": [{"role": "user", "content": "What is up?"}], "max_tokens": 16,
        "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert read_counters(endpoint, "tiny", {})["num_drafts"] > 0


def _until(what, deadline_s: float = 600):
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        found = what()
        if found:
            return found
        time.sleep(0.5)
    pytest.fail(f"gave up waiting for {what.__doc__}")


@pytest.mark.timeout(1800)
def test_serve_follows_production_through_a_promotion_and_a_rollback(workspace, tiny, prepared, tmp_path,
                                                                      monkeypatch, vllm_python):
    ft = invoke("finetune", "--data", str(prepared), "--init", "tiny", "--steps", "2", "--gpus", "1",
                "--tokens-per-batch", "512", "--val-fraction", "0")
    for _ in range(2):  # two versions of one drafter: what a promotion and a rollback move between
        invoke("export", "--run", ft["run_id"], "--registered-model", "tiny-drafter", "--vllm-check", "off")
    policy = tmp_path / "production.yaml"
    policy.write_text("stage: Production\nexport_validated: false\n")
    invoke("promote", "tiny-drafter", "1", "--to", "Production", "--policy", str(policy))

    port, log, host = free_port(), tmp_path / "vllm.log", "ci-host"
    endpoint = f"http://127.0.0.1:{port}/v1"
    env = {**os.environ, "DRAFTLINE_HOST": host, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
           "MLFLOW_TRACKING_URI": f"sqlite:///{workspace / 'mlflow.db'}"}
    serve = subprocess.Popen(
        [sys.executable, "-m", "draftline.cli", "serve", "tiny-drafter", "--stage", "Production", "--dest",
         str(tmp_path / "drafters"), "--verifier", str(tiny["verifier"]), "--vllm",
         f"{vllm_python} -m vllm.entrypoints.openai.api_server", "--follow-minutes", "0.05", "--stop-timeout", "60",
         "--log", str(log), "--", "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny",
         "--max-model-len", "512", "--enforce-eager", "--dtype", "float32"],
        env=env, stderr=subprocess.PIPE, text=True)
    client = MlflowClient()

    def tag(version: str, what: str) -> str | None:
        return client.get_model_version("tiny-drafter", version).tags.get(f"served.{host}.{what}")

    try:
        _drafting(endpoint, log)
        assert tag("1", "since") and not tag("1", "until")
        promoted = time.monotonic()
        invoke("promote", "tiny-drafter", "2", "--to", "Production", "--policy", str(policy))
        _until(lambda: tag("2", "since"))
        _drafting(endpoint, log)
        switch_s = time.monotonic() - promoted
        assert tag("1", "until") and json.loads(Path(tmp_path / "drafters" / "v2" / "checksums.json").read_text())
        invoke("rollback", "tiny-drafter", "--reason", "serve test", "--policy", str(policy))
        _until(lambda: tag("2", "until"))
        _drafting(endpoint, log)
        assert tag("1", "since") > tag("2", "since")  # served again since the rollback (ISO times)
        serve.send_signal(signal.SIGTERM)
        _, err = serve.communicate(timeout=120)
    finally:
        if serve.poll() is None:
            serve.kill()
    assert serve.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "switching from version 1 to 2" in err and "switching from version 2 to 1" in err, err[-3000:]
    assert tag("1", "until") > tag("1", "since")
    print(f"promote to the new drafter serving: {switch_s:.0f} s (follow every 3 s, vLLM restarted on the CPU)")
