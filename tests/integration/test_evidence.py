"""Promotion on evidence, against a real `mlflow server`: an evaluation set built from prompts only (held-out
demo prompts answered by the tiny verifier through its OpenAI-compatible server), the tiny parent, a child that
beats it (promoted) and a drafter worse than the version in Production (refused with the delta), each measured
teacher-forced and by real chain speculative decoding, and the numbers on the versions' models. The rule
against the parent failing is tested in unit/registry/test_registry.py."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from mlflow import MlflowClient

from draftline import names
from draftline.cli import cli
from tests.kit.tiny_server import serve_in_thread

from ..conftest import DEMO

pytestmark = pytest.mark.integration
EVAL_PROMPTS = DEMO.parent / "eval_prompts.jsonl"  # prompts only, held out of the demo conversations trained on


def invoke(*args, code=0):
    r = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert r.exit_code == code, r.output
    return json.loads(r.stdout) if code == 0 and r.stdout.lstrip().startswith("{") else r.output


@pytest.mark.timeout(2400)  # two regenerations, two finetunes, four evaluations: ~6 min quiet, far more under load
def test_promotion_on_evidence(server_workspace, tiny):
    client = MlflowClient()
    verifier = str(tiny["verifier"])
    with serve_in_thread(verifier) as server:  # stands in for `vllm serve <verifier>`
        ev = invoke("prepare", "--conversations", str(EVAL_PROMPTS), "--verifier", verifier, "--name", "evaluation",
                    "--regenerate-endpoint", server.url, "--regenerate-max-tokens", "32", "--max-length", "256")
        train = invoke("prepare", "--conversations", str(DEMO), "--verifier", verifier, "--max-length", "256",
                       "--max-samples", "64", "--regenerate-endpoint", server.url, "--regenerate-max-tokens", "32")

    common = ("--data", ev["data_uri"], "--max-new-tokens", "24")
    parent = invoke("evaluate", "--target", "tiny", *common)
    assert parent["lossless"] is True and parent["prompts"] >= 10  # some answers run past --max-length
    assert 1.0 <= parent["measured_acceptance_length"] <= 1.0 + 3

    steps = ("--gpus", "1", "--tokens-per-batch", "512", "--warmup-steps", "0", "--val-every", "10")
    good = invoke("finetune", "--data", train["data_uri"], "--init", "tiny", "--vocab", "rebuild", "--steps", "60",
                  "--lr", "3e-3", "--eval-data", ev["data_uri"], *steps)
    run = client.get_run(good["run_id"])
    # the parent measured before step 1, on the fixed evaluation set, and the best checkpoint handed on
    assert run.data.params[names.EVAL_DATA_DIGEST] == ev["digest"]
    start = [m for m in client.get_metric_history(good["run_id"], names.VAL_ACCEPTANCE_LENGTH) if m.step == 0]
    assert start and run.data.metrics[names.PARENT_VAL_ACCEPTANCE_LENGTH] == start[0].value

    child = invoke("evaluate", "--target", f"runs:/{good['run_id']}", *common)  # before export: carried over
    assert child["lossless"] is True
    assert child["measured_acceptance_length"] > parent["measured_acceptance_length"], (child, parent)
    v1 = invoke("export", "--run", good["run_id"], "--registered-model", "ev-drafter")["version"]
    from draftline.util import manifest_digest

    tags = MlflowClient().get_model_version("ev-drafter", v1).tags  # the file list a pull reads instead of listing
    assert manifest_digest(json.loads(tags[names.EXPORT_CHECKSUMS])) == tags[names.EXPORT_SHA256]
    assert set(json.loads(tags[names.EXPORT_CHECKSUMS])) >= {"config.json", "model.safetensors", "README.md"}
    promoted = invoke("promote", "ev-drafter", v1, "--to", "Production")
    assert "PASS  eval/acceptance_length not worse than parent" in promoted

    # a drafter barely moved from the tiny parent (one step): no worse than that parent, but worse than the
    # version serving now, measured on the same set: refused, with the numbers and the delta
    bad = invoke("finetune", "--data", train["data_uri"], "--init", "tiny", "--steps", "1", "--lr", "5e-4",
                 "--val-fraction", "0", *steps)
    v2 = invoke("export", "--run", bad["run_id"], "--registered-model", "ev-drafter")["version"]
    worse = invoke("evaluate", "--target", f"models:/ev-drafter/{v2}", *common)
    assert worse["lossless"] is True  # a poor drafter accepts less; the output stays the verifier's own
    assert worse["measured_acceptance_length"] < child["measured_acceptance_length"] - 0.02, (worse, child)
    refused = invoke("promote", "ev-drafter", v2, "--to", "Production", code=1)
    assert "FAIL  eval/acceptance_length not worse than current Production - 0.02" in refused, refused
    assert "vs current Production" in refused and "(-0." in refused and "nothing changed" in refused
    assert client.get_model_version_by_alias("ev-drafter", "production").version == v1

    # what the registry's compare-versions view shows: the version's model carries the evaluation, linked
    # to the evaluation data set; the recommended num_speculative_tokens went into the exported config
    from draftline.registry.versions import model_id_of

    mv = client.get_model_version("ev-drafter", v1)
    metrics = {m.key: m for m in client.get_logged_model(model_id_of(mv)).metrics}
    measured = metrics[names.MEASURED_ACCEPTANCE_LENGTH]
    assert measured.dataset_name == "evaluation" and measured.dataset_digest == ev["digest"][:36]
    assert abs(measured.value - child["measured_acceptance_length"]) < 1e-3
    pulled = invoke("pull", "ev-drafter", "--stage", "Production", "--dest", str(server_workspace / "p"), "--json")
    config = json.loads((Path(pulled["path"]) / "config.json").read_text())
    k = config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    assert k == child["recommended_num_speculative_tokens"]
