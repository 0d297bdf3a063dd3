"""draftline serve's loop: the vLLM command a version gets, and following a stage through promotions, rollbacks,
failed pulls and a registry that does not answer, with signals forwarded. vLLM stands in here as a process that
prints its arguments and waits (real vLLM serving a promoted version: tests/integration/test_serve.py)."""

from __future__ import annotations

import json
import shlex
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from draftline.errors import DraftlineError, VerificationError
from draftline.serving import deploy

WAITS = [sys.executable, "-c", "import json, sys, time; print(json.dumps(sys.argv[1:]), flush=True); time.sleep(600)"]


def _version(n: str, root: Path = Path("/srv/d"), **kw) -> deploy.Version:
    spec = {"model": f"{root}/v{n}", "method": "eagle3", "num_speculative_tokens": 3}
    return deploy.Version(number=n, directory=root / f"v{n}", spec=spec, verifier="/models/Kimi-K2.5",
                          trust_remote_code=kw.get("trust", True), dtype=kw.get("dtype", "bfloat16"))


def test_the_vllm_command_serves_the_verifier_with_the_versions_drafter_and_the_hosts_flags():
    cmd = deploy.argv(["vllm", "serve"], _version("7"), ["--tensor-parallel-size", "8", "--dtype", "auto"])
    assert cmd[:4] == ["vllm", "serve", "--model", "/models/Kimi-K2.5"]
    assert json.loads(cmd[cmd.index("--speculative-config") + 1]) == {
        "model": "/srv/d/v7", "method": "eagle3", "num_speculative_tokens": 3}
    assert "--trust-remote-code" in cmd and cmd.count("--dtype") == 1  # the host's own --dtype wins
    assert cmd[-4:] == ["--tensor-parallel-size", "8", "--dtype", "auto"]


def test_a_missing_vllm_is_one_line_naming_the_fix(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setenv("DRAFTLINE_VLLM_PYTHON", "off")
    with pytest.raises(DraftlineError, match="no vLLM here.*--vllm"):
        deploy.launcher(None)
    with pytest.raises(DraftlineError, match="is not an executable here"):
        deploy.launcher("/opt/nowhere/vllm serve")


def test_following_the_stage_switches_on_promotion_and_rollback_and_never_leaves_the_host_without_one(tmp_path):
    names = iter(["1", "1", "registry down", "2", "2", "1"])  # what the stage names at each check
    pulls: list[str] = []
    events: list[tuple[str, str]] = []
    said: list[str] = []
    stop = deploy.Stop()

    def current() -> str:
        n = next(names, "1")
        if n == "registry down":
            raise DraftlineError("tracking server http://mlflow:5000 unavailable")
        return n

    def pull(n: str) -> deploy.Version:
        pulls.append(n)
        if n == "2" and pulls.count("2") == 1:
            raise VerificationError("model.safetensors: sha256 differs from checksums.json")
        return _version(n, tmp_path)

    def record(n: str, what: str, _when: str) -> None:
        events.append((n, what))
        if events[-2:] == [("2", "until"), ("1", "since")]:  # the rollback is served: stop as systemd would
            threading.Timer(0.5, lambda: setattr(stop, "signum", signal.SIGTERM)).start()

    log = tmp_path / "vllm.log"
    follow = deploy.Follow(current=current, pull=pull, record=record)
    code = deploy.serve(follow, WAITS, ["--port", "8000"], every_s=0.3, stop_timeout_s=10, say=said.append,
                        log=log, stop=stop)
    assert code == 128 + signal.SIGTERM
    assert events == [("1", "since"), ("1", "until"), ("2", "since"), ("2", "until"), ("1", "since"),
                      ("1", "until")]
    assert pulls == ["1", "2", "2", "1"]  # the failed pull was retried at the next check
    assert any("did not say which version" in s and "version 1 keeps serving" in s for s in said)
    assert any("version 2 could not be pulled (model.safetensors" in s and "keeps serving" in s for s in said)
    started = [shlex.split(s.split(": ", 1)[1]) for s in said if s.startswith("serving version")]
    assert [json.loads(a[a.index("--speculative-config") + 1])["model"] for a in started] == [
        f"{tmp_path}/v1", f"{tmp_path}/v2", f"{tmp_path}/v1"]
    assert (tmp_path / "serving").resolve() == tmp_path / "v1"  # what observe --drafter DEST/serving reads
    assert all(a[-2:] == ["--port", "8000"] for a in started)
    assert json.loads(log.read_text().splitlines()[0]) == started[0][len(WAITS):]  # what vLLM itself was given


def test_vllm_exiting_ends_serve_with_its_status(tmp_path):
    follow = deploy.Follow(current=lambda: "4", pull=lambda n: _version(n, tmp_path), record=lambda *a: None)
    exits = [sys.executable, "-c", "import sys; sys.exit(3)"]
    t = time.monotonic()
    assert deploy.serve(follow, exits, [], every_s=None, stop_timeout_s=5, say=lambda s: None) == 3
    assert time.monotonic() - t < 30


def test_the_gpu_policy_set_is_shipped_and_named_from_any_folder(tmp_path, monkeypatch):
    """`promote --policy gpu` and DRAFTLINE_REGISTRY_POLICIES=gpu name the set draftline ships, from any folder
    (a serving host has no checkout); a folder of the team's own is still taken as a folder."""
    from draftline.registry.policy_file import load_policy, policy_path, shipped_sets

    monkeypatch.chdir(tmp_path)
    assert "gpu" in shipped_sets()
    assert load_policy(policy_path("Production", "gpu")).min_speedup.value == 1.05
    monkeypatch.setenv("DRAFTLINE_REGISTRY_POLICIES", "gpu")
    assert policy_path("Staging") == policy_path("Staging", "gpu") and policy_path("Staging").is_file()
    own = tmp_path / "gpu"
    own.mkdir()
    (own / "production.yaml").write_text("stage: Production\n")
    assert policy_path("Production").resolve() == own / "production.yaml"  # a folder named gpu here: the team's
