"""Teams: against `mlflow server --app-name basic-auth` (on sqlite, and on PostgreSQL), a READ user can pull but
is refused promote."""

import json

import pytest
from click.testing import CliRunner

from draftline import names
from draftline.cli import cli
from draftline.drafter.aux_ids import served_aux_fields

from ..conftest import ADMIN
from ..unit.registry.test_registry import TAGS

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("server", ["auth_server", "team_server"])
def test_read_user_pulls_but_cannot_promote(workspace, server, request, monkeypatch, tmp_path):
    """On sqlite, and on the team setup (PostgreSQL for runs, registry and users)."""
    import mlflow
    from mlflow import MlflowClient
    from mlflow.server import get_app_client

    from draftline.export.upload import CHECKSUMS, sha256_manifest
    from draftline.util import manifest_digest

    auth_server = request.getfixturevalue(server)

    monkeypatch.setenv("MLFLOW_TRACKING_URI", auth_server)
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", ADMIN[0])
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", ADMIN[1])
    mlflow.set_tracking_uri(auth_server)
    get_app_client("basic-auth", tracking_uri=auth_server).create_user("reader", "reader-password-123")

    export = tmp_path / "drafter"
    export.mkdir()
    (export / "config.json").write_text(json.dumps({"speculators_config": {"verifier": {"name_or_path": "/v"}},
                                                    **served_aux_fields([2, 4, 5])}))  # ids both runners read
    (export / "model.safetensors").write_bytes(b"\0" * 64)
    manifest = sha256_manifest(export)
    (export / CHECKSUMS).write_text(json.dumps(manifest))
    mlflow.set_experiment("team")
    with mlflow.start_run() as run:
        mlflow.log_artifacts(str(export), "drafter")
    client = MlflowClient()
    client.create_registered_model("team-drafter")
    client.create_model_version("team-drafter", f"{run.info.artifact_uri}/drafter", run_id=run.info.run_id,
                                tags={**TAGS, "metric.val/acceptance_length": "1.5", "metric.train/acceptance_length": "1.5",
                                      names.EXPORT_SHA256: manifest_digest(manifest)})

    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "reader")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "reader-password-123")
    runner = CliRunner()
    pulled = runner.invoke(cli, ["pull", "team-drafter", "--version", "1", "--dest", str(tmp_path / "p"), "--json"])
    assert pulled.exit_code == 0, pulled.output
    assert json.loads(pulled.stdout)["version"] == "1"

    refused = runner.invoke(cli, ["promote", "team-drafter", "1", "--to", "Staging"])  # its policy passes
    assert refused.exit_code == 1
    assert "permission denied: reader may read team-drafter but not change its stages" in refused.output
    assert "Traceback" not in refused.output
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", ADMIN[0])
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", ADMIN[1])
    assert client.get_model_version("team-drafter", "1").current_stage == "None"

    # and no credential reached a param, tag or artifact of the run
    data = client.get_run(run.info.run_id).data
    assert ADMIN[1] not in json.dumps({**data.params, **data.tags})
