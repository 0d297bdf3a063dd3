"""Promotion through registry_policies/ on a real (sqlite) registry: pass, fail, dry run, aliases."""

import json

import mlflow
from click.testing import CliRunner
from mlflow import MlflowClient

from draftline import names
from draftline.cli import cli

TAGS = {"init": "tiny", names.PARENT_SOURCE: "draftline/tiny-parent", names.PARENT_SHA256: "ab" * 32,
        names.PARENT_LAYOUT: "midlayer", names.VOCAB_POLICY: "parent", names.VERIFIER_NAME_OR_PATH: "/v",
        names.VERIFIER_AUX_LAYERS: "[2, 4, 5]", names.DATA_DIGEST: "cd" * 32, names.FINETUNE_RUN_ID: "r1",
        names.EXPORT_SHA256: "ef" * 32, names.EXPORT_VALIDATED: "true", names.TRAIN_PAIRING: "vllm-shifted"}


EVAL_DIGEST = "ee" * 18  # the digest MLflow keeps for a data set (36 hex digits)


def evaluation_set(name="evaluation", digest=EVAL_DIGEST):
    from draftline.registry.lineage import data_set

    return data_set({"source": f"/data/{name}", "digest": digest}, name)


def evaluate_model(model_id, teacher_forced, measured=None, lossless=1.0, dataset=None):
    """What `draftline evaluate` attaches to a drafter's LoggedModel (numbers chosen by the test)."""
    metrics = {names.TEACHER_FORCED_ACCEPTANCE_LENGTH: teacher_forced}
    if measured is not None:
        metrics.update({names.MEASURED_ACCEPTANCE_LENGTH: measured, names.LOSSLESS: lossless,
                        names.MEASURED_PROMPTS: 16.0})
    with mlflow.start_run():
        mlflow.log_metrics(metrics, step=0, model_id=model_id, dataset=dataset or evaluation_set())
        if measured is not None:  # per-prompt evidence: 16 prompts alike, 100 drafts each
            from draftline.registry.confidence import PER_PROMPT_FILE, prompt_key

            rows = [{"key": prompt_key([i]), "drafts": 100, "accepted": round((measured - 1) * 100),
                     "accepted_per_pos": [0, 0, 0], "generated": 100} for i in range(16)]
            mlflow.log_text("".join(json.dumps(r) + "\n" for r in rows), PER_PROMPT_FILE)


def evaluated_parent(teacher_forced=1.0, measured=None, sha="ab" * 32):
    """The external parent (as finetune records AQ-MedAI), evaluated on the evaluation set."""
    parent = mlflow.create_external_model(name="tiny-parent", model_type="eagle3-drafter",
                                          tags={names.KIND: "parent", names.PARENT_SHA256_TAG: sha})
    evaluate_model(parent.model_id, teacher_forced, measured)
    return parent.model_id


def _version(client, name, acc, *, evaluated=True, measured=None, parent=1.0, **extra):
    """A registered version from its own LoggedModel, evaluated (teacher-forced ``acc``, and ``measured``) on the
    evaluation set; the parent external model is created once per experiment, evaluated at ``parent``."""
    try:
        client.create_registered_model(name)
    except Exception:  # noqa: BLE001
        pass
    exp = mlflow.tracking.fluent._get_experiment_id()  # noqa: SLF001
    found = client.search_logged_models([exp], filter_string="tags.`draftline.kind` = 'parent'").to_list()
    if parent is not None and not found:
        evaluated_parent(parent)
    tags = {**TAGS, "metric.val/acceptance_length": str(acc), "metric.train/acceptance_length": str(acc), **extra}
    model = mlflow.initialize_logged_model(name=name, model_type="eagle3-drafter")
    with mlflow.start_run() as run:
        mlflow.log_text("weights", "drafter/model.txt")
    if evaluated:
        evaluate_model(model.model_id, acc, measured)
    mlflow.finalize_logged_model(model.model_id, "READY")
    return client.create_model_version(name, source=f"models:/{model.model_id}", run_id=run.info.run_id,
                                       tags={k: v for k, v in tags.items() if v}, model_id=model.model_id)


def promote(*args):
    return CliRunner().invoke(cli, ["promote", *args], catch_exceptions=False)


def test_promotion_gates(store):
    client = MlflowClient()
    mlflow.set_experiment(f"gates-{store}")
    _version(client, "d", 1.5)
    r = promote("d", "1", "--to", "Production", "--dry-run")
    assert r.exit_code == 0 and "dry run" in r.stdout and "PASS  eval/acceptance_length >= 1.05" in r.stdout
    assert client.get_model_version("d", "1").current_stage == "None"  # nothing changed

    assert promote("d", "1", "--to", "Production").exit_code == 0
    assert str(client.get_model_version_by_alias("d", "production").version) == "1"
    assert client.get_model_version("d", "1").tags["promoted.production.policy"] == "production.yaml"

    _version(client, "d", 1.45)  # worse than Production by more than the 0.02 margin
    r = promote("d", "2", "--to", "Production")
    assert r.exit_code == 1
    assert "FAIL  eval/acceptance_length not worse than current Production - 0.02" in r.output
    assert "teacher-forced 1.4500 vs current Production 1.5000 (-0.0500)" in r.output
    assert "nothing changed" in r.output
    assert str(client.get_latest_versions("d", stages=["Production"])[0].version) == "1"

    _version(client, "d", 1.6, **{names.DATA_DIGEST: ""})
    r = promote("d", "3", "--to", "Production")
    assert r.exit_code == 1 and "missing: data.digest" in r.output

    _version(client, "d", 1.7)
    assert promote("d", "4", "--to", "Production").exit_code == 0
    assert client.get_model_version("d", "1").current_stage == "Archived"  # exactly one Production
    assert [str(v.version) for v in client.get_latest_versions("d", stages=["Production"])] == ["4"]

    assert promote("d", "2", "--to", "Staging").exit_code == 0
    assert str(client.get_model_version_by_alias("d", "staging").version) == "2"


def test_a_version_trained_before_the_pairing_fix_is_refused_and_not_compared_with(workspace, tmp_path):
    """Versions registered before draftline trained in vLLM's pairing carry no train.pairing tag: promotion
    refuses them with the reason, and their (inflated, unshifted) metrics never block a retrained version."""
    client = MlflowClient()
    _version(client, "old", 1.9, **{names.TRAIN_PAIRING: ""})
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
    legacy = tmp_path / "by-validation.yaml"  # a policy on training metrics, as before evaluation sets
    legacy.write_text("stage: Production\nnot_worse_than_current: {metric: val/acceptance_length, margin: 0.02}\n")
    r = promote("old", "2", "--to", "Production", "--policy", str(legacy))
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


def test_production_compares_with_the_parent_on_the_same_evaluation_set(workspace):
    """The shipped Production policy: the version and its parent (an external model, as AQ-MedAI is) on one
    evaluation set, measured against measured; a version worse than its parent is refused with the delta."""
    client = MlflowClient()
    mlflow.set_experiment("evidence")
    evaluated_parent(teacher_forced=1.5, measured=1.6)
    _version(client, "ev", 1.4, measured=1.55)  # worse than the parent it came from
    r = promote("ev", "1", "--to", "Production")
    assert r.exit_code == 1 and "nothing changed" in r.output
    assert "FAIL  eval/acceptance_length not worse than parent" in r.output
    assert "measured 1.5500 vs parent 1.6000 (-0.0500)" in r.output

    _version(client, "ev", 1.7, measured=1.8)
    r = promote("ev", "2", "--to", "Production")
    assert r.exit_code == 0, r.output
    assert "PASS  eval/acceptance_length not worse than parent" in r.output and "(+0.2000)" in r.output

    _version(client, "ev", 1.9, evaluated=False)  # never evaluated: refused, with the command that fixes it
    r = promote("ev", "3", "--to", "Production")
    assert r.exit_code == 1 and "FAIL  evaluated on evaluation" in r.output
    assert "draftline evaluate --target models:/ev/3" in r.output


def test_numbers_from_different_evaluation_sets_are_never_compared(workspace):
    client = MlflowClient()
    mlflow.set_experiment("other-sets")
    parent = mlflow.create_external_model(name="p", tags={names.PARENT_SHA256_TAG: "ab" * 32})
    evaluate_model(parent.model_id, 1.1, dataset=evaluation_set(digest="12" * 18))  # same name, other data
    _version(client, "x", 1.5, parent=None)
    r = promote("x", "1", "--to", "Production")
    assert r.exit_code == 1
    assert "evaluated on another data set named evaluation (121212121212, not eeeeeeeeeeee)" in r.output
    assert "draftline evaluate --target tiny" in r.output  # the parent, by the init that named it


def test_a_lossy_measurement_blocks_production(workspace):
    client = MlflowClient()
    mlflow.set_experiment("lossy")
    v = _version(client, "l", 1.5, measured=1.6)
    evaluate_model(v.source.removeprefix("models:/"), 1.5, measured=1.6, lossless=0.0)
    r = promote("l", "1", "--to", "Production")
    assert r.exit_code == 1 and "FAIL  speculative decoding lossless" in r.output
