"""Promotion through registry_policies/ on a real (sqlite) registry: pass, fail, dry run, aliases."""

import mlflow
from click.testing import CliRunner
from mlflow import MlflowClient

from draftline.cli import cli

TAGS = {"init": "tiny", "parent.source": "draftline/tiny-parent", "parent.sha256": "ab" * 32,
        "parent.layout": "midlayer", "vocab.policy": "parent", "verifier.name_or_path": "/v",
        "verifier.aux_layers": "[2, 4, 5]", "data.digest": "cd" * 32, "finetune.run_id": "r1",
        "export.sha256": "ef" * 32, "export.validated": "true", "train.pairing": "vllm-shifted"}


def _version(client, name, acc, **extra):
    try:
        client.create_registered_model(name)
    except Exception:  # noqa: BLE001
        pass
    tags = {**TAGS, "metric.val/acceptance_length": str(acc), "metric.train/acceptance_length": str(acc), **extra}
    with mlflow.start_run() as run:
        mlflow.log_text("weights", "drafter/model.txt")
    return client.create_model_version(name, source=f"{run.info.artifact_uri}/drafter", run_id=run.info.run_id,
                                       tags={k: v for k, v in tags.items() if v})


def promote(*args):
    return CliRunner().invoke(cli, ["promote", *args], catch_exceptions=False)


def test_promotion_gates(store):
    client = MlflowClient()
    mlflow.set_experiment(f"gates-{store}")
    _version(client, "d", 1.5)
    r = promote("d", "1", "--to", "Production", "--dry-run")
    assert r.exit_code == 0 and "dry run" in r.stdout and "PASS  val/acceptance_length >= 1.2" in r.stdout
    assert client.get_model_version("d", "1").current_stage == "None"  # nothing changed

    assert promote("d", "1", "--to", "Production").exit_code == 0
    assert str(client.get_model_version_by_alias("d", "production").version) == "1"
    assert client.get_model_version("d", "1").tags["promoted.production.policy"] == "production.yaml"

    _version(client, "d", 1.45)  # worse than Production by more than the 0.02 margin
    r = promote("d", "2", "--to", "Production")
    assert r.exit_code == 1
    assert "FAIL  val/acceptance_length not worse than current Production (v1) - 0.02" in r.output
    assert "nothing changed" in r.output
    assert str(client.get_latest_versions("d", stages=["Production"])[0].version) == "1"

    _version(client, "d", 1.6, **{"data.digest": ""})
    r = promote("d", "3", "--to", "Production")
    assert r.exit_code == 1 and "missing: data.digest" in r.output

    _version(client, "d", 1.7)
    assert promote("d", "4", "--to", "Production").exit_code == 0
    assert client.get_model_version("d", "1").current_stage == "Archived"  # exactly one Production
    assert [str(v.version) for v in client.get_latest_versions("d", stages=["Production"])] == ["4"]

    assert promote("d", "2", "--to", "Staging").exit_code == 0
    assert str(client.get_model_version_by_alias("d", "staging").version) == "2"


def test_a_version_trained_before_the_pairing_fix_is_refused_and_not_compared_with(workspace):
    """Versions registered before draftline trained in vLLM's pairing carry no train.pairing tag: promotion
    refuses them with the reason, and their (inflated, unshifted) metrics never block a retrained version."""
    client = MlflowClient()
    _version(client, "old", 1.9, **{"train.pairing": ""})
    for stage in ("Staging", "Production"):
        r = promote("old", "1", "--to", stage)
        assert r.exit_code == 1 and "nothing changed" in r.output
        assert "FAIL  train.pairing is vllm-shifted" in r.output
        assert "train.pairing=(not recorded), needs vllm-shifted" in r.output and "retrain it" in r.output
    assert client.get_model_version("old", "1").current_stage == "None"

    # a registry that already serves a pre-fix version (promoted before the policy required the pairing)
    client.transition_model_version_stage("old", "1", "Production")
    client.set_registered_model_alias("old", "production", "1")
    _version(client, "old", 1.3)  # lower than 1.9, but 1.9 was measured in another pairing
    r = promote("old", "2", "--to", "Production")
    assert r.exit_code == 0, r.output
    assert "v1 was trained in another pairing (unshifted): its metrics are not comparable" in r.output
    assert str(client.get_model_version_by_alias("old", "production").version) == "2"


def test_unknown_version_and_bad_policy(workspace, tmp_path):
    client = MlflowClient()
    _version(client, "e", 1.5)
    r = promote("e", "9", "--to", "Production")
    assert r.exit_code == 1 and "models:/e/9 does not exist" in r.output
    bad = tmp_path / "p.yaml"
    bad.write_text("stage: Production\nexport_validated: maybe\n")
    r = promote("e", "1", "--to", "Production", "--policy", str(bad))
    assert r.exit_code == 2 and "export_validated" in r.output
