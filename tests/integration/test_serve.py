"""`draftline serve` from a serving host's light install (no torch, no transformers) on real vLLM: the tiny
verifier served with the drafter Production names from a real `mlflow server`, a promotion followed to the new
version and a rollback back, each switch recorded on the versions, `observe` as a sidecar recording on the version
vLLM runs, a promoted version that fails verification left unserved while the serving one serves, SIGTERM forwarded
and vLLM's status returned. Skipped, saying why, without the vLLM venv (CI builds it and requires it)."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import mlflow
import pytest
from click.testing import CliRunner
from mlflow import MlflowClient

from draftline import names
from draftline.cli import cli
from draftline.registry.versions import model_id_of
from draftline.serving.client import read_counters
from draftline.util import free_port

from ..conftest import _registry_as_found
from .conftest import clean_env

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
    assert _ask(endpoint).status_code == 200
    assert read_counters(endpoint, "tiny", {})["num_drafts"] > 0


def _ask(endpoint: str) -> httpx.Response:
    return httpx.post(endpoint + "/chat/completions", timeout=120, json={
        "model": "tiny", "messages": [{"role": "user", "content": "What is up?"}], "max_tokens": 16,
        "temperature": 0, "ignore_eos": True})


class Traffic(threading.Thread):
    """Requests one after another, as users send them, so that every observe window sees drafts."""

    def __init__(self, endpoint: str):
        super().__init__(daemon=True)
        self.endpoint, self.done = endpoint, threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            try:
                _ask(self.endpoint)
            except httpx.HTTPError:  # vLLM restarting on a switch
                self.done.wait(1)


def _until(what, deadline_s: float = 600):
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        found = what()
        if found:
            return found
        time.sleep(0.5)
    pytest.fail(f"gave up waiting for {what.__doc__}")


@pytest.mark.timeout(1800)
def test_serve_from_the_light_install_follows_production_and_observe_follows_serve(
        workspace, tiny, prepared, tmp_path, monkeypatch, vllm_python, mlflow_server, light_install, request):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    monkeypatch.setenv("DRAFTLINE_EXPERIMENT", "serve")
    mlflow.set_tracking_uri(mlflow_server)
    request.addfinalizer(_registry_as_found(mlflow_server))
    name = "served-drafter"
    ft = invoke("finetune", "--data", str(prepared), "--init", "tiny", "--steps", "2", "--gpus", "1",
                "--tokens-per-batch", "512", "--val-fraction", "0")
    for _ in range(3):  # what a promotion and a rollback move between, and a version whose files fail their check
        invoke("export", "--run", ft["run_id"], "--registered-model", name, "--vllm-check", "off")
    client = MlflowClient()
    client.set_model_version_tag(name, "3", names.EXPORT_SHA256, "0" * 64)  # its files are not the ones registered
    policy = tmp_path / "production.yaml"
    policy.write_text("stage: Production\nexport_validated: false\n")
    invoke("promote", name, "1", "--to", "Production", "--policy", str(policy))

    port, log, err, host = free_port(), tmp_path / "vllm.log", tmp_path / "serve.err", "ci-host"
    endpoint, dest = f"http://127.0.0.1:{port}/v1", tmp_path / "drafters"
    light = light_install["venv"] / "bin" / "draftline"
    env = {**clean_env(), "DRAFTLINE_HOST": host, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
           "MLFLOW_TRACKING_URI": mlflow_server, "DRAFTLINE_EXPERIMENT": "serve"}
    with open(err, "w") as stderr:
        serve = subprocess.Popen(
            [str(light), "serve", name, "--stage", "Production", "--dest", str(dest), "--verifier",
             str(tiny["verifier"]), "--vllm", f"{vllm_python} -m vllm.entrypoints.openai.api_server",
             "--follow-minutes", "0.05", "--stop-timeout", "60", "--log", str(log), "--", "--host", "127.0.0.1",
             "--port", str(port), "--served-model-name", "tiny", "--max-model-len", "512", "--enforce-eager",
             "--dtype", "float32"], env=env, stderr=stderr, text=True)
    observe, traffic = None, Traffic(endpoint)

    def tag(version: str, what: str) -> str | None:
        return client.get_model_version(name, version).tags.get(f"served.{host}.{what}")

    def observed(version: str) -> bool:
        """observe's record on the version's LoggedModel"""
        if observe.poll() is not None:
            pytest.fail(f"observe ended ({observe.returncode}): {observe.stderr.read()[-3000:]}")
        model = client.get_logged_model(model_id_of(client.get_model_version(name, version)))
        return "served/acceptance_length" in {m.key for m in model.metrics}

    try:
        _drafting(endpoint, log)
        assert tag("1", "since") and not tag("1", "until")
        observe = subprocess.Popen(
            [str(light), "observe", "--endpoint", endpoint, "--drafter", str(dest / "serving"), "--model", "tiny",
             "--window", "2", "--every-minutes", "0.05"], env=env, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True)
        traffic.start()
        _until(lambda: observed("1"))
        promoted = time.monotonic()
        invoke("promote", name, "2", "--to", "Production", "--policy", str(policy))
        _until(lambda: tag("2", "since"))
        _drafting(endpoint, log)
        switch_s = time.monotonic() - promoted
        assert tag("1", "until") and json.loads((dest / "v2" / "checksums.json").read_text())
        _until(lambda: observed("2"))  # the sidecar followed the switch
        invoke("rollback", name, "--reason", "serve test", "--policy", str(policy))
        _until(lambda: tag("2", "until"))
        _drafting(endpoint, log)
        assert tag("1", "since") > tag("2", "since")  # served again since the rollback (ISO times)
        invoke("promote", name, "3", "--to", "Production", "--policy", str(policy))
        _until(lambda: "version 3 could not be pulled" in err.read_text())
        _drafting(endpoint, log)  # version 1 still serves
        assert not tag("3", "since") and (dest / "serving").resolve().name == "v1"
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=120)
    finally:
        traffic.done.set()
        for p in (serve, observe):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    said = err.read_text()
    assert serve.returncode == 128 + signal.SIGTERM, said[-3000:]
    assert "switching from version 1 to 2" in said and "switching from version 2 to 1" in said, said[-3000:]
    assert "version 1 keeps serving" in said and "sha256" in said.split("version 3 could not be pulled")[1]
    assert tag("1", "until") > tag("1", "since")
    followed = observe.stderr.read()
    assert f"now serving models:/{name}/2 (was v1)" in followed, followed[-3000:]
    print(f"promote to the new drafter serving: {switch_s:.0f} s (follow every 3 s, vLLM restarted on the CPU)")
