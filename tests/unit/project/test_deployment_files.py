"""The serving deployment files the repository ships (deploy/systemd, deploy/kubernetes) kept true to the code:
each command they run is a draftline command with options it declares and values it accepts, and the registry's
credentials come from the environment or a Secret, never a command line. (Real vLLM started through `draftline
serve` on a promoted version: tests/integration/test_serve.py.)"""

from __future__ import annotations

import re
import shlex

import click
import pytest
import yaml

from draftline.cli import cli

from ...conftest import ROOT

DEPLOY = ROOT / "deploy"
ENV = {"DRAFTER": "kimi-k25-drafter", "VERIFIER": "/models/Kimi-K2.5", "VLLM": "/opt/vllm/bin/vllm serve"}
SECRETS = ("MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_USERNAME", "password", "token")


def _unit(path) -> dict[str, dict[str, list[str]]]:
    """A systemd unit file's sections, each key's values in order (systemd allows a key more than once)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        assert current is not None and "=" in line, f"{path.name}: not a systemd line: {line!r}"
        key, value = line.split("=", 1)
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def _systemd_argv(exec_start: str, env: dict[str, str]) -> list[str]:
    """ExecStart as systemd splits it: words first, then ${VAR} replaced by the whole value as one word."""
    return [re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], word) for word in shlex.split(exec_start)]


def _parses(argv: list[str], where: str) -> dict:
    """The params the draftline command ``argv`` (``draftline <command> ...``) would run with."""
    assert argv[0].endswith("draftline"), f"{where} runs {argv[0]}, not draftline"
    command = cli.commands.get(argv[1])
    assert command is not None, f"{where}: draftline has no command {argv[1]!r}"
    try:
        return dict(command.make_context(argv[1], list(argv[2:]), resilient_parsing=False).params)
    except click.ClickException as e:
        pytest.fail(f"{where}: `draftline {argv[1]}` refuses its arguments: {e.format_message()}")


def test_the_systemd_units_run_draftline_serve_and_observe_with_what_they_declare():
    serve_unit = _unit(DEPLOY / "systemd" / "draftline-serve.service")
    service = serve_unit["Service"]
    assert service["EnvironmentFile"] == ["/etc/draftline/serving.env"] and service["KillSignal"] == ["SIGTERM"]
    (start,) = service["ExecStart"]
    params = _parses(_systemd_argv(start, ENV), "draftline-serve.service")
    assert (params["name"], params["stage"], params["verifier"]) == ("kimi-k25-drafter", "Production",
                                                                      "/models/Kimi-K2.5")
    assert params["vllm_cmd"] == "/opt/vllm/bin/vllm serve" and params["follow_minutes"] == 5
    vllm = [a for a in params["vllm_args"] if a != "--"]
    assert vllm[vllm.index("--tensor-parallel-size") + 1] == "8" and "--reasoning-parser" in vllm
    # systemd gives the stop time the serve command asks of vLLM, and a little more
    assert int(service["TimeoutStopSec"][0]) > params["stop_timeout"]

    observe = _unit(DEPLOY / "systemd" / "draftline-observe.service")
    (start,) = observe["Service"]["ExecStart"]
    observed = _parses(_systemd_argv(start, ENV), "draftline-observe.service")
    # the version vLLM runs (serve's DEST/serving link), not the stage, which moves before serve follows it
    assert observed["drafter_dir"] == f"{params['dest']}/serving" and observed["every_minutes"] == 15
    assert observe["Unit"]["After"] == ["draftline-serve.service"]
    for text in ((DEPLOY / "systemd" / n).read_text() for n in ("draftline-serve.service",
                                                                "draftline-observe.service")):
        assert not any(s in line for line in text.splitlines() if line.startswith("ExecStart") for s in SECRETS)


def test_the_kubernetes_deployment_pulls_serves_and_observes_with_credentials_from_a_secret():
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "serving.yaml").read_text()))
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    containers = {c["name"]: c for c in pod["containers"]}
    pulled = _parses(init["command"], "the init container")
    served = _parses(containers["vllm"]["command"], "the vllm container")
    observed = _parses(containers["observe"]["command"], "the observe sidecar")
    assert (pulled["name"], pulled["stage"]) == (served["name"], served["stage"]) == ("kimi-k25-drafter",
                                                                                       "Production")
    assert observed["drafter_dir"] == f"{served['dest']}/serving" and observed["version"] is None
    assert {m["mountPath"] for m in containers["observe"]["volumeMounts"]} == {"/drafters"}
    assert served["follow_minutes"] and served["vllm_cmd"] == "vllm serve"
    mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    assert pulled["dest"].startswith(mounts["drafters"]) and served["dest"].startswith(mounts["drafters"])
    cache = {c["name"]: {e["name"]: e.get("value") for e in c.get("env", [])} for c in (init, containers["vllm"])}
    assert cache["pull-drafter"]["DRAFTLINE_CACHE_DIR"] == cache["vllm"]["DRAFTLINE_CACHE_DIR"]  # one cache
    for c in (init, *containers.values()):
        assert c["envFrom"] == [{"secretRef": {"name": "draftline-registry"}}], c["name"]
        assert not any(s in " ".join(c["command"]) for s in SECRETS), c["name"]
    assert pod["terminationGracePeriodSeconds"] > served["stop_timeout"]
    assert containers["vllm"]["readinessProbe"]["httpGet"]["path"] == "/health"
