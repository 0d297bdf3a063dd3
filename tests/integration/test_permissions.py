"""Every registry command under MLflow's permissions, against a real `mlflow server --app-name basic-auth`: a user
who may read the registered model but not edit it, and one who may not read it. Each command either does what
that user may do or answers in one line that names the permission it lacks, exits non-zero, and changes
nothing in the registry (stages, aliases, tags, versions, runs)."""

import contextlib
import json
import os

import mlflow
import pytest
from click.testing import CliRunner
from mlflow import MlflowClient

from draftline import names
from draftline.cli import cli
from draftline.drafter.aux_ids import served_aux_fields
from draftline.export.upload import CHECKSUMS, sha256_manifest
from draftline.util import manifest_digest

from ..conftest import ADMIN
from ..kit.vllm_metrics import metrics_server as serving_metrics
from ..unit.registry.test_registry import TAGS, evaluate_model, evaluated_parent

pytestmark = pytest.mark.integration

MODEL = "guarded"
EXPERIMENT = "guarded-team"
USERS = {"viewer": "viewer-password-123", "stranger": "stranger-password-123"}


@pytest.fixture(scope="module")
def registry(auth_server, tmp_path_factory):
    """As the admin: ``guarded`` v1 (Production, @production) and v2, a finished finetune run, and two users:
    ``viewer`` (MLflow's default READ on everything) and ``stranger`` (DENY on the model)."""
    from mlflow.server import get_app_client

    mp = pytest.MonkeyPatch()
    mp.setenv("MLFLOW_TRACKING_URI", auth_server)
    mp.setenv("MLFLOW_TRACKING_USERNAME", ADMIN[0])
    mp.setenv("MLFLOW_TRACKING_PASSWORD", ADMIN[1])
    mp.setenv("DRAFTLINE_EXPERIMENT", EXPERIMENT)
    mp.chdir(tmp_path_factory.mktemp("permissions"))
    mlflow.set_tracking_uri(auth_server)
    auth = get_app_client("basic-auth", tracking_uri=auth_server)
    for user, password in USERS.items():
        auth.create_user(user, password)
    mlflow.set_experiment(EXPERIMENT)
    client = MlflowClient()
    client.create_registered_model(MODEL)
    evaluated_parent(1.0, 1.0)
    for _ in range(2):
        _exported_version(client, tmp_path_factory.mktemp("export"))
    client.transition_model_version_stage(MODEL, "1", "Production")
    client.set_registered_model_alias(MODEL, "production", "1")
    with mlflow.start_run(tags={names.STEP: "finetune"}) as finetune:
        mlflow.log_param(names.VERIFIER_NAME_OR_PATH, "/v")
    auth.grant_user_permission("stranger", "registered_model", MODEL, "DENY")
    yield {"uri": auth_server, "finetune": finetune.info.run_id}
    mp.undo()


def _exported_version(client, export):
    """A version as `draftline export` registers it: its LoggedModel holds the drafter's files and their
    checksums, evaluated on the evaluation set (observe's promise)."""
    (export / "config.json").write_text(json.dumps({"speculators_config": {"verifier": {"name_or_path": "/v"}},
                                                    **served_aux_fields([2, 4, 5])}))
    (export / "model.safetensors").write_bytes(b"\0" * 64)
    manifest = sha256_manifest(export)
    (export / CHECKSUMS).write_text(json.dumps(manifest))
    model = mlflow.initialize_logged_model(name=MODEL, model_type="eagle3-drafter")
    client.log_model_artifacts(model.model_id, str(export))
    evaluate_model(model.model_id, 1.5, 1.5)
    mlflow.finalize_logged_model(model.model_id, "READY")
    with mlflow.start_run() as run:
        pass
    return client.create_model_version(
        MODEL, source=f"models:/{model.model_id}", run_id=run.info.run_id, model_id=model.model_id,
        tags={**TAGS, "metric.val/acceptance_length": "1.5", "metric.train/acceptance_length": "1.5",
              names.EXPORT_SHA256: manifest_digest(manifest)})


@contextlib.contextmanager
def _admin():
    saved = {k: os.environ.get(k) for k in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")}
    os.environ.update(MLFLOW_TRACKING_USERNAME=ADMIN[0], MLFLOW_TRACKING_PASSWORD=ADMIN[1])
    try:
        yield
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


@pytest.fixture
def metrics_server():
    """A serving vLLM's counters, for observe."""
    with serving_metrics() as served:
        yield served


def snapshot(uri: str) -> dict:
    """What a command could change, read as the admin."""
    with _admin():
        return _snapshot(uri)


def _snapshot(uri: str) -> dict:
    client = MlflowClient(tracking_uri=uri)
    model = client.get_registered_model(MODEL)
    versions = sorted((v.version, v.current_stage, sorted(v.tags.items()))
                      for v in client.search_model_versions(f"name='{MODEL}'"))
    experiment = client.get_experiment_by_name(EXPERIMENT)
    runs = len(client.search_runs([experiment.experiment_id], run_view_type=3))
    return {"aliases": model.aliases, "tags": model.tags, "description": model.description, "versions": versions,
            "runs": runs, "experiments": len(client.search_experiments(view_type=3))}


def as_user(monkeypatch, registry: dict, user: str) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", registry["uri"])  # each test starts without one (tests/conftest.py)
    monkeypatch.setenv("DRAFTLINE_EXPERIMENT", EXPERIMENT)
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", user)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", USERS[user])


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args))


REFUSED = [
    # (user, command, what the line says)
    ("viewer", ["promote", MODEL, "2", "--to", "Staging"], "viewer may read guarded but not change its stages"),
    ("viewer", ["rollback", MODEL, "--to", "2", "--reason", "test"], "viewer may read guarded but not change its stages"),
    ("viewer", ["export", "--run", "{finetune}", "--registered-model", MODEL, "--vllm-check", "off"],
     "viewer lacks EDIT permission on registered model guarded, needed to register a version of guarded"),
    ("stranger", ["promote", MODEL, "2", "--to", "Staging"], "stranger lacks READ permission on registered model"),
    ("stranger", ["rollback", MODEL, "--to", "2", "--reason", "test"], "stranger lacks READ permission on registered model"),
    ("stranger", ["export", "--run", "{finetune}", "--registered-model", MODEL, "--vllm-check", "off"],
     "stranger lacks READ and EDIT permission on registered model guarded"),
    ("stranger", ["pull", MODEL, "--stage", "Production", "--dest", "{tmp}/pulled"],
     "stranger lacks READ permission on registered model guarded"),
    ("stranger", ["list", MODEL], "stranger lacks READ permission on registered model guarded"),
    ("stranger", ["lineage", MODEL, "1"], "stranger lacks READ permission on registered model guarded"),
    ("stranger", ["observe", "--endpoint", "{endpoint}", "--version", f"models:/{MODEL}/1", "--window", "1"],
     "stranger lacks READ permission on registered model guarded"),
]


@pytest.mark.parametrize(("user", "command", "said"), REFUSED,
                         ids=[f"{u}-{c[0]}" for u, c, _ in REFUSED])
def test_a_command_this_user_may_not_run_is_one_line_and_changes_nothing(registry, metrics_server, user, command,
                                                                          said, monkeypatch, tmp_path):
    counters, endpoint = metrics_server
    before = snapshot(registry["uri"])
    as_user(monkeypatch, registry, user)
    args = [a.format(finetune=registry["finetune"], tmp=tmp_path, endpoint=endpoint) for a in command]
    out = invoke(*args)
    assert out.exit_code == 1, out.output
    assert said in out.output
    assert out.output.startswith("error: permission denied:") and out.output.count("\n") == 1, out.output
    assert "ask an MLflow admin" in out.output and "Traceback" not in out.output
    assert snapshot(registry["uri"]) == before
    assert not (tmp_path / "pulled").exists()


def test_observe_by_a_user_who_may_not_log_runs_is_refused_after_its_window_and_records_nothing(
        registry, metrics_server, monkeypatch):
    """observe writes a run, not the model: the permission it lacks is the experiment's."""
    counters, endpoint = metrics_server
    counters.script[2] = (40, [30, 20, 10])  # traffic inside the window
    before = snapshot(registry["uri"])
    as_user(monkeypatch, registry, "viewer")
    out = invoke("observe", "--endpoint", endpoint, "--version", f"models:/{MODEL}/1", "--window", "1")
    assert out.exit_code == 1, out.output
    assert "permission denied: viewer lacks EDIT permission on the experiment it logs to, needed to start the " \
           "observe run" in out.output
    assert "Traceback" not in out.output
    assert snapshot(registry["uri"]) == before


@pytest.mark.parametrize(("command", "said"), [
    (["pull", MODEL, "--stage", "Production", "--dest", "{tmp}/pulled"], "pulled models:/guarded/1"),
    (["list", MODEL], "Production @production"), (["list"], "@production=v1"),
    (["lineage", MODEL, "Production"], "models:/guarded/1 [Production]")])
def test_what_a_reader_may_do_it_does(registry, command, said, monkeypatch, tmp_path):
    before = snapshot(registry["uri"])
    as_user(monkeypatch, registry, "viewer")
    out = invoke(*[a.format(tmp=tmp_path) for a in command])
    assert out.exit_code == 0, out.output
    assert said in out.output
    assert snapshot(registry["uri"]) == before


def test_a_model_this_user_may_not_read_is_not_listed(registry, monkeypatch):
    as_user(monkeypatch, registry, "stranger")
    out = invoke("list")
    assert out.exit_code == 0, out.output
    assert MODEL not in out.output
