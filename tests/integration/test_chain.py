"""The whole chain on the tiny verifier against a real `mlflow server` on loopback: prepare -> finetune
(DeepSpeed ZeRO-2, 2 CPU ranks, from the tiny AQ-MedAI-layout parent) -> export -> promote -> pull, then a
second generation finetuned from the registered first one (ZeRO-3, 2 ranks, rebuilt vocabulary) and the
three-generation lineage."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from mlflow import MlflowClient

from draftline import names
from draftline.cli import cli
from draftline.drafter.checkpoints import find_checkpoint
from draftline.util import files_digest

from ..conftest import DEMO

pytestmark = pytest.mark.integration  # two generations, ZeRO-2 and ZeRO-3: 2 minutes


def invoke(*args):
    r = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout) if r.stdout.lstrip().startswith("{") else r.stdout


def test_chain_against_mlflow_server(server_workspace, tiny, tmp_path):
    client = MlflowClient()
    prep = invoke("prepare", "--conversations", str(DEMO), "--verifier", str(tiny["verifier"]),
                  "--max-length", "256", "--max-samples", "160")
    ft = invoke("finetune", "--data", prep["data_uri"], "--init", "tiny", "--gpus", "2", "--zero-stage", "2",
                "--steps", "6", "--tokens-per-batch", "512", "--save-every", "3", "--lr", "5e-4",
                "--warmup-steps", "0", "--micro-batch-tokens", "128")  # the two ranks split their steps alike
    run = client.get_run(ft["run_id"])
    p = run.data.params
    assert p[names.TRAIN_MICRO_BATCH_TOKENS] == "128"
    assert p[names.TRAIN_ATTN_IMPL] == "blockwise"  # auto, on CPU ranks
    assert p["init"] == "tiny" and p[names.PARENT_SOURCE] == "draftline/tiny-parent"
    assert p[names.PARENT_LAYOUT] == "midlayer" and p[names.PARENT_KEY_REMAP] == "midlayer.->layers.0."
    assert p[names.PARENT_SHA256] == files_digest(find_checkpoint(tiny["parent"]).weights)
    assert p[names.ZERO_STAGE] == "2" and p["world_size"] == "2" and p[names.VOCAB_POLICY] == "parent"
    # --precision auto (the default) measured this CPU and says what it found
    assert p[names.TRAIN_PRECISION] in ("bf16", "fp32") and p[names.TRAIN_PRECISION_CHOICE].startswith("auto: a bf16 matmul")
    assert p[names.DATA_DIGEST] == prep["digest"] and run.data.tags[names.DATA_RUN] == prep["run_id"]
    loss = client.get_metric_history(ft["run_id"], names.TRAIN_LOSS)
    assert [m.step for m in loss] == [1, 2, 3, 4, 5, 6]
    for key in (names.TRAIN_FULL_ACC_0, "train/cond_acc_2", names.TRAIN_ACCEPTANCE_LENGTH, names.TRAIN_TOKENS_PER_S):
        assert key in run.data.metrics
    # the verifier as serving hosts know it (make-tiny records its id), the training host's path beside it
    assert p[names.VERIFIER_NAME_OR_PATH] == "draftline/tiny-verifier"
    assert p[names.VERIFIER_PATH] == str(Path(tiny["verifier"]).resolve())
    assert run.data.tags["mlflow.runName"] == "finetune from tiny" and "tiny-verifier" in \
        run.data.tags["mlflow.note.content"]
    # inputs: the same data set prepare logged, and the parent as an external model keyed by its sha256
    prep_run = client.get_run(prep["run_id"])
    assert prep_run.inputs.dataset_inputs[0].dataset.digest == prep["digest"][:36]
    assert [i.dataset.digest for i in run.inputs.dataset_inputs] == [prep["digest"][:36]]
    assert run.inputs.dataset_inputs[0].dataset.name == prep_run.inputs.dataset_inputs[0].dataset.name
    [parent_input] = run.inputs.model_inputs
    parent_model = client.get_logged_model(parent_input.model_id)
    assert parent_model.tags[names.PARENT_SHA256_TAG] == p[names.PARENT_SHA256]
    assert parent_model.params["source"] == "draftline/tiny-parent"
    artifacts = {a.path for a in client.list_artifacts(ft["run_id"])}
    assert {"weights", "training_metadata.json", "parent_load_report.json",
            "per_position_accuracy.png"} <= artifacts
    assert "checkpoints" not in artifacts  # weights-only hand-off: no optimizer state leaves the work directory
    assert {a.path for a in client.list_artifacts(ft["run_id"], "weights")} == {
        "weights/model.safetensors", "weights/layer_config.json", "weights/selection.json",
        "weights/training_metadata.json"}
    assert names.VAL_ACCEPTANCE_LENGTH in run.data.metrics and "system/cpu_utilization_percentage" in run.data.metrics
    # the parent is measured before step 1, on the same held-out samples, and the best checkpoint is handed on
    [at_start] = [m for m in client.get_metric_history(ft["run_id"], names.VAL_ACCEPTANCE_LENGTH) if m.step == 0]
    assert run.data.metrics[names.PARENT_VAL_ACCEPTANCE_LENGTH] == at_start.value
    assert run.data.tags["draftline.checkpoint.selected"] == "best"
    assert int(run.data.tags["draftline.checkpoint.best_step"]) <= int(run.data.tags["draftline.checkpoint.last_step"])

    ex = invoke("export", "--run", ft["run_id"], "--registered-model", "tiny-drafter", "--layout", "midlayer")
    assert ex["model_uri"] == "models:/tiny-drafter/1"
    mv = client.get_model_version("tiny-drafter", "1")
    assert mv.tags[names.PARENT_SOURCE] == "draftline/tiny-parent" and mv.tags[names.EXPORT_VALIDATED] == "true"
    assert mv.tags[names.FINETUNE_RUN_ID] == ft["run_id"] and mv.tags[names.DATA_DIGEST] == prep["digest"]
    assert "draftline/tiny-parent" in mv.description
    # the version comes from the drafter's LoggedModel: lineage as its params, the finetune metrics on it
    from draftline.registry.versions import model_id_of

    assert mv.source == f"models:/{model_id_of(mv)}"
    logged = client.get_logged_model(model_id_of(mv))
    assert logged.source_run_id == ex["run_id"] and logged.status == "READY"
    assert logged.params[names.PARENT_SHA256] == p[names.PARENT_SHA256] and logged.params[names.DATA_DIGEST] == prep["digest"]
    assert logged.params[names.TRAIN_PAIRING] == "vllm-shifted"
    # as mlflow.register_model records it: the model's page in the UI lists the version registered from it
    assert [(v["name"], str(v["version"])) for v in json.loads(logged.tags["mlflow.modelVersions"])] == [
        ("tiny-drafter", "1")]
    assert {m.key for m in logged.metrics} >= {names.VAL_ACCEPTANCE_LENGTH, names.TRAIN_LOSS}
    assert mv.tags[names.VERIFIER_NAME_OR_PATH] == "draftline/tiny-verifier"

    integrity = tmp_path / "integrity.yaml"  # the shipped Production policy wants an evaluation: test_evidence.py
    integrity.write_text("stage: Production\nrequire_tags: [parent.sha256, data.digest]\nexport_validated: true\n")
    invoke("promote", "tiny-drafter", "1", "--to", "Production", "--policy", str(integrity))
    assert client.get_model_version_by_alias("tiny-drafter", "production").version == "1"
    pulled = invoke("pull", "tiny-drafter", "--stage", "Production", "--dest", str(tmp_path / "pulled"), "--json")
    assert pulled["version"] == "1" and "--speculative-config" in pulled["command"]
    assert json.loads((tmp_path / "pulled" / "checksums.json").read_text()) == json.loads(mv.tags[names.EXPORT_CHECKSUMS])
    assert pulled["speculative_config"]["method"] == "eagle3"
    by_alias = invoke("pull", "tiny-drafter", "--alias", "production", "--dest", str(tmp_path / "a"), "--json")
    by_version = invoke("pull", "tiny-drafter", "--version", "1", "--dest", str(tmp_path / "v"), "--json")
    assert by_alias["version"] == by_version["version"] == "1"
    r = CliRunner().invoke(cli, ["pull", "tiny-drafter", "--version", "1", "--dest", str(tmp_path / "w"),
                                 "--verifier", "another/verifier"])
    assert r.exit_code == 1 and "was trained for verifier draftline/tiny-verifier" in r.output
    assert not (tmp_path / "w").exists()  # refused before anything was downloaded
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "mine.txt").write_text("untouched")
    r = CliRunner().invoke(cli, ["pull", "tiny-drafter", "--version", "1", "--dest", str(keep),
                                 "--verifier", "another/verifier"])
    assert r.exit_code == 1 and [f.name for f in keep.iterdir()] == ["mine.txt"]

    # what deployments get loads with speculators itself, with the aux layers and verifier vLLM needs
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    cfg = Eagle3SpeculatorConfig.from_pretrained(pulled["path"])
    cfg.transformer_layer_config._attn_implementation = "sdpa"
    assert cfg.speculators_config.verifier.name_or_path == "draftline/tiny-verifier"  # what `vllm serve DIR` loads
    cfg.speculators_config.verifier.name_or_path = str(tiny["verifier"])  # this host has it here
    model = Eagle3DraftModel.from_pretrained(pulled["path"], config=cfg)
    assert model.config.eagle_aux_hidden_state_layer_ids == [2, 4, 5]
    assert pulled["verifier"] == "draftline/tiny-verifier" and pulled["command"].startswith(
        "vllm serve draftline/tiny-verifier ")
    card = (tmp_path / "pulled" / "README.md").read_text()
    assert "base_model: draftline/tiny-parent" in card

    # warm start: from the tiny parent the first step is far ahead of a random init on the same data
    rnd = invoke("finetune", "--data", prep["data_uri"], "--init", "random", "--gpus", "1", "--steps", "1",
                 "--tokens-per-batch", "512", "--draft-vocab-size", "256", "--val-fraction", "0")
    first = {r: client.get_metric_history(r, names.TRAIN_FULL_ACC_0)[0] for r in (ft["run_id"], rnd["run_id"])}
    assert first[ft["run_id"]].step == first[rnd["run_id"]].step == 1
    assert first[ft["run_id"]].value > first[rnd["run_id"]].value + 0.2, first

    # generation 2: parent = a registered version; ZeRO-3 over 2 ranks; a vocabulary rebuilt from the data
    ft = invoke("finetune", "--data", prep["data_uri"], "--init", "models:/tiny-drafter/1",
                "--vocab", "rebuild", "--draft-vocab-size", "200", "--zero-stage", "3", "--gpus", "2",
                "--steps", "2", "--tokens-per-batch", "512", "--save-every", "2")
    run = client.get_run(ft["run_id"])
    p = run.data.params
    assert p[names.PARENT_SOURCE] == "models:/tiny-drafter/1" and p[names.PARENT_LAYOUT] == "speculators"
    assert p[names.PARENT_KEY_REMAP] == "none" and p[names.ZERO_STAGE] == "3" and p[names.VOCAB_POLICY] == "rebuild"
    assert int(p[names.VOCAB_KEPT]) + int(p[names.VOCAB_ADDED]) == 200 and int(p[names.VOCAB_DROPPED]) >= 56
    assert run.data.tags[names.PARENT_MODEL_VERSION] == "models:/tiny-drafter/1"
    # its input is generation 1's own LoggedModel: data -> finetune -> model -> version, clickable both ways
    assert [i.model_id for i in run.inputs.model_inputs] == [model_id_of(client.get_model_version("tiny-drafter", "1"))]
    assert run.data.tags[names.PARENT_RUN] == client.get_model_version("tiny-drafter", "1").run_id
    ex = invoke("export", "--run", ft["run_id"], "--registered-model", "tiny-drafter")  # consolidates ZeRO-3
    mv = client.get_model_version("tiny-drafter", ex["version"])
    assert mv.tags[names.PARENT_SOURCE] == "models:/tiny-drafter/1" and mv.tags[names.VOCAB_DRAFT_SIZE] == "200"
    assert mv.tags[names.EXPORT_VALIDATED] == "true"

    # three generations: v2 <- v1 <- the tiny parent (external root, with its sha256)
    r = CliRunner().invoke(cli, ["lineage", "tiny-drafter", ex["version"], "--json"], catch_exceptions=False)
    chain = json.loads(r.stdout)
    assert [g["uri"] for g in chain] == [f"models:/tiny-drafter/{ex['version']}", "models:/tiny-drafter/1",
                                         "draftline/tiny-parent"]
    assert chain[-1]["kind"] == "root" and len(chain[-1]["sha256"]) == 64
    assert chain[0]["data_digest"] == chain[1]["data_digest"]
    text = CliRunner().invoke(cli, ["lineage", "tiny-drafter", ex["version"]]).stdout
    assert text.startswith(f"tiny-drafter/{ex['version']} <- tiny-drafter/1 <- draftline/tiny-parent (sha256 ")

    # a pulled file altered on disk is not served again: it shares no bytes with the cache, so the next pull
    # hands out the verified bytes
    weights = tmp_path / "pulled" / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    weights.write_bytes(bytes(raw))
    again = invoke("pull", "tiny-drafter", "--version", "1", "--dest", str(tmp_path / "again"), "--json")
    from draftline.util import file_sha256

    checksums = json.loads((Path(again["path"]) / "checksums.json").read_text())
    assert file_sha256(Path(again["path"]) / "model.safetensors") == checksums["model.safetensors"]
