"""``draftline plan``: exact parameter counts on the meta device, DeepSpeed's estimators per ZeRO stage, the
activation estimate against what autograd really keeps, the fit verdict, the CLI and finetune's hook."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from draftline.cli import cli
from draftline.drafter import layer_kinds
from draftline.drafter import shape as drafter_shape
from draftline.train import plan

GIB = 1 << 30
# The Kimi-K2 drafter, by hand: hidden 7168, 64 heads x 128, intermediate 18432, 3 aux layers, vocab 163840/32000
H, Q, I, V, DV = 7168, 64 * 128, 18432, 163840, 32000
TRAINABLE = H * 3 * H + 3 * Q * 2 * H + H * Q + 3 * H * I + 4 * H  # fc, q/k/v, o, mlp, 3 layer norms + norm
FROZEN = V * H + DV * H + DV * H + H  # embed_tokens, lm_head, verifier_lm_head, verifier_norm


@pytest.fixture(scope="module")
def kimi() -> dict:
    return plan.make_plan(gpu_memory_gib=None)


def test_kimi_k2_counts_are_exact(kimi):
    assert kimi["trainable"] == TRAINABLE == 961_572_864
    assert kimi["frozen"] == FROZEN == 1_633_164_288
    assert kimi["params"] == TRAINABLE + FROZEN == 2_594_737_152
    assert kimi["frozen_names"] == ["embed_tokens", "lm_head", "verifier_lm_head", "verifier_norm"]
    assert kimi["largest_layer"] == {"name": "fc", "params": H * 3 * H}
    assert kimi["largest_frozen_layer"] == {"name": "embed_tokens", "params": V * H}
    json.dumps(kimi)


def test_stages_on_8_gpus_follow_deepspeed(kimi):
    s = {int(k): v for k, v in kimi["stages"].items()}
    p, n = TRAINABLE, 8
    assert s[2]["model_states"] == 2 * p + 18 * p // n  # DeepSpeed's stage-2 estimator, no offload
    assert s[3]["model_states"] == 4 * H * 3 * H + 18 * p // n  # stage 3: 4 x largest layer + 18P/N
    assert s[1]["model_states"] == 4 * p + 16 * p // n
    assert s[3]["model_states"] < s[2]["model_states"] < s[1]["model_states"] < s[0]["model_states"]
    per_gpu = [s[k]["model_states"] + s[k]["frozen"] for k in (3, 2, 1)]
    assert per_gpu == sorted(per_gpu) and len(set(per_gpu)) == 3
    buffers = s[2]["frozen"] - 2 * FROZEN  # frozen: bf16 on every GPU, plus the t2d/d2t/rotary buffers
    assert V + 8 * DV <= buffers < V + 8 * DV + 4096
    assert s[3]["frozen"] == 2 * FROZEN // n + 2 * V * H + buffers  # partitioned; the embedding gathered
    assert all(v["fits"] is None for v in s.values()) and kimi["budget_bytes"] is None
    assert "SW: Model with 961M total params, 154M largest layer params" in kimi["deepspeed_estimators"]


def test_the_default_is_the_missions_gpu_over_pcie_and_zero2_is_chosen_for_both_layers():
    """8 x RTX PRO 6000 (96 GB, no NVLink): every stage fits both Kimi drafters; ZeRO-1/2 send what ZeRO-0 sends
    (the gradients reduced, the parameters gathered: 2 x 7/8 x 2P bytes), ZeRO-3 1.5x that plus the frozen
    parameters it partitions, so ZeRO-2 is the one to use, and the arithmetic, not PCIe, bounds its step."""
    for layer in ("llama", "mla"):
        p = plan.make_plan(layer=layer)
        assert p["gpu_memory_gib"] == 95.0 and all(s["fits"] for s in p["stages"].values())
        t = p["interconnect"]
        assert t["link"] == "pcie" and t["bandwidth_gb_s"] == 63.0 and "PCI-SIG" in t["bandwidth_source"]
        sent = {k: v["sent_bytes"] for k, v in t["stages"].items()}
        assert sent["0"] == sent["1"] == sent["2"] == int(7 / 8 * 2 * 2 * p["trainable"])
        assert sent["3"] == int(7 / 8 * 2 * (3 * p["trainable"] + 2 * p["frozen"]))
        assert p["recommended_stage"] == 2, p["recommended_because"]
        assert "the arithmetic bounds a step" in p["recommended_because"]
        assert t["stages"]["3"]["link_over_compute"] > 1 > t["stages"]["2"]["link_over_compute"]
    nvlink = plan.make_plan(link="nvlink")["interconnect"]["stages"]["2"]["link_s"]
    assert nvlink == pytest.approx(plan.make_plan()["interconnect"]["stages"]["2"]["link_s"] * 63 / 900)
    assert plan.make_plan(gpus=1)["interconnect"]["stages"]["3"]["sent_bytes"] == 0


def test_zero3_is_chosen_where_only_it_fits():
    p = plan.make_plan(layer="mla", gpus=8, gpu_memory_gib=72)  # ZeRO-2 67.0 GiB, ZeRO-3 62.8 of 64.8
    assert [k for k, s in p["stages"].items() if s["fits"]] == ["3"]
    assert p["recommended_stage"] == 3 and "only stage that fits" in p["recommended_because"]


def test_the_plan_sizes_the_missions_shards():
    p = plan.make_plan(layer="mla")["storage"]
    assert (p["samples"], p["tokens"], p["bytes_per_token"]) == (25_000, 75_000_000, 57_353)
    assert 4.30e12 < p["bytes"] < 4.31e12 and p["offered"] == ["bf16", "fp8"] and "assumed" in p["tokens_source"]
    assert p["bytes_by_storage"] == {"bf16": p["bytes"], "fp8": 75_000_000 * (4 * (7168 + 4) + 9)}


def test_fits_on_8_b200_and_not_on_small_gpus():
    big = plan.make_plan(gpus=8, gpu_memory_gib=180, zero_stage=2)
    assert big["fits"] is True and all(s["fits"] for s in big["stages"].values())
    assert plan.fit_error(big, 2) is None
    small = plan.make_plan(gpus=8, gpu_memory_gib=8, zero_stage=3)
    assert small["fits"] is False and not any(s["fits"] for s in small["stages"].values())
    msg = plan.fit_error(small, 3)
    assert msg.startswith("ZeRO-3 does not fit") and "--tokens-per-batch" in msg
    tokens = small["stages"]["3"]["max_tokens_per_batch"]  # the suggested batch does fit
    assert plan.make_plan(gpus=8, gpu_memory_gib=8, tokens_per_batch=tokens)["stages"]["3"]["fits"]
    assert not plan.make_plan(gpus=8, gpu_memory_gib=8, tokens_per_batch=tokens + 64)["stages"]["3"]["fits"]


def test_message_offers_a_higher_stage_and_more_gpus(kimi):
    one, three = kimi["stages"]["1"]["total"], kimi["stages"]["3"]["total"]
    mem = (one + three) / 2 / GIB / 0.9  # ZeRO-3 fits, ZeRO-1 does not
    p = plan.make_plan(gpus=8, gpu_memory_gib=mem)
    assert not p["stages"]["1"]["fits"] and p["stages"]["3"]["fits"]
    msg = plan.fit_error(p, 1)
    assert msg.startswith("ZeRO-1 does not fit") and any(f"--zero-stage {k}" in msg for k in (2, 3))
    assert "more GPUs" in msg and p["stages"]["1"]["min_gpus"] > 8


@pytest.mark.parametrize("layer", ["llama", "mla"])
@pytest.mark.parametrize("attn", ["sdpa", "blockwise"])
def test_activation_estimate_matches_what_autograd_saves(attn, layer):
    """The estimate's saved part against the tensors autograd keeps for a scaled-down drafter (CPU), one sample
    filling the pack (blockwise's most): a Llama layer with grouped K/V heads, and an MLA one (DeepSeek's head
    dims, a query LoRA)."""
    import torch
    from speculators.models.eagle3 import Eagle3DraftModel

    from draftline.drafter.model import loss_config

    h, v, dv, t, k = 256, 4096, 1024, 256, 3
    if layer == "llama":
        shape = dict(hidden_size=h, intermediate_size=640, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=64, vocab_size=v)
        cfg = layer_kinds.LlamaLayer.drafter_config(shape, draft_vocab_size=dv, aux_layer_ids=[1, 2, 3])
        repeated_kv = 2 * 2 * (2 * 64) * k  # the K/V cache of 2 heads, repeated to 4 before attention
    else:
        shape = dict(hidden_size=h, intermediate_size=640, num_attention_heads=4, num_key_value_heads=4,
                     q_lora_rank=128, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                     vocab_size=v, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        cfg = layer_kinds.MlaLayer.drafter_config(shape, draft_vocab_size=dv, aux_layer_ids=[1, 2, 3])
        repeated_kv = 0  # MLA expands its latent into every head: nothing repeated
    est = plan.activation_bytes(plan.count_params(cfg)["shape"], t, k, "bf16", attn)
    cfg.transformer_layer_config._attn_implementation = attn
    torch.manual_seed(0)
    model = Eagle3DraftModel(cfg)
    ids = torch.arange(dv) * (v // dv)
    model.load_vocab_mappings(torch.zeros(v, dtype=torch.bool).index_fill_(0, ids, True), ids - torch.arange(dv))
    model = model.to(torch.bfloat16)
    batch = {"input_ids": torch.randint(0, v, (1, t)), "loss_mask": torch.ones(1, t, dtype=torch.bool),
             "hidden_states": torch.randn(1, t, 3 * h).bfloat16(),
             "verifier_last_hidden_states": torch.randn(1, t, h).bfloat16(),
             "position_ids": torch.arange(t).unsqueeze(0), "document_ids": torch.zeros(1, t, dtype=torch.long)}
    skip = {p.data_ptr() for p in model.parameters()} | {b.data_ptr() for b in model.buffers()}
    saved: dict[int, int] = {}

    def keep(x):
        st = x.untyped_storage()
        if st.data_ptr() not in skip:
            saved[st.data_ptr()] = st.nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda x: x):
        model(**batch, ttt_steps=k, loss_config=loss_config())
    # alive but not saved for the backward: transient, verifier hidden state, target logits and their fp32
    # log-probabilities and probabilities, the K/V cache (2 heads)
    alive_not_saved = t * (est["transient"] + 2 * (h + dv) + 8 * dv + repeated_kv)
    assert sum(saved.values()) == pytest.approx(est["bytes"] - alive_not_saved, rel=0.01)


def test_the_kimi_k25_mla_drafter_is_planned_at_lightseeks_size():
    mla = plan.make_plan(layer="mla", gpu_memory_gib=None)
    assert mla["shape"]["layer"] == "mla" and mla["shape"]["draft_vocab_size"] == V
    # lightseekorg/kimi-k2.5-eagle3-mla: ~1.8 B parameters in its checkpoint, ~3.0 B with the shared embeddings
    assert 1.80e9 < mla["checkpoint_params"] < 1.88e9 and 2.98e9 < mla["checkpoint_params_with_embeddings"] < 3.05e9
    assert mla["checkpoint_params_with_embeddings"] - mla["checkpoint_params"] == V * H
    reduced = plan.make_plan(layer="mla", draft_vocab_size=DV, gpu_memory_gib=None)
    assert mla["checkpoint_params"] - reduced["checkpoint_params"] == (V - DV) * H  # the lm_head rows
    with pytest.raises(Exception, match="draft vocabulary 200000"):
        plan.make_plan(layer="mla", draft_vocab_size=200000)


def test_configs_from_disk_speculators_and_specforge(tmp_path, kimi):
    spec_dir = tmp_path / "speculators"
    drafter_shape.default_config().save_pretrained(str(spec_dir))
    from_dir = plan.make_plan(spec_dir, gpu_memory_gib=None)
    assert (from_dir["params"], from_dir["trainable"]) == (kimi["params"], kimi["trainable"])
    specforge = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
                 "intermediate_size": I, "num_attention_heads": 64, "num_key_value_heads": 64, "head_dim": 128,
                 "num_hidden_layers": 1, "vocab_size": V, "draft_vocab_size": DV, "rms_norm_eps": 1e-5,
                 "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 30, 58]}}
    (tmp_path / "aq.json").write_text(json.dumps(specforge))
    assert plan.make_plan(tmp_path / "aq.json", gpu_memory_gib=None)["params"] == kimi["params"]
    (tmp_path / "other.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(plan.ConfigError, match="neither a speculators EAGLE-3 config"):
        plan.make_plan(tmp_path / "other.json")


@pytest.fixture()
def run():
    runner = CliRunner()
    return lambda *args: runner.invoke(cli, [str(a) for a in args], catch_exceptions=False)


def test_cli_json_parses(run):
    r = run("plan", "--json", "--gpus", "4", "--drafter-layer", "llama")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["params"] == TRAINABLE + FROZEN and out["gpus_per_node"] == 4 and set(out["stages"]) == {"0", "1",
                                                                                                        "2", "3"}


def test_cli_table_and_exit_1_when_the_chosen_stage_does_not_fit(run):
    ok = run("plan", "--zero-stage", "2")
    assert ok.exit_code == 0 and "ZeRO-2" in ok.stdout and "<- chosen" in ok.stdout
    assert "use: --zero-stage 2: ZeRO-2 fits" in ok.stdout and "interconnect: pcie at 63 GB/s" in ok.stdout
    assert "prepared shards: 4.3 TB for 25,000 samples x 3,000 tokens" in ok.stdout
    assert "1.1 TB" in run("plan", "--samples", "25000", "--tokens-per-sample", "768").stdout
    r = run("plan", "--gpu-memory-gib", "8", "--zero-stage", "2", "--drafter-layer", "llama")
    assert r.exit_code == 1
    assert "error: ZeRO-2 does not fit" in r.stderr and "--tokens-per-batch" in r.stderr
    assert "Traceback" not in r.output


def test_finetune_hook_logs_plan_json_and_fits(tmp_path, monkeypatch):
    """CPU run: the fit is not checked; plan.json and plan.fits=unchecked land on the run."""
    import mlflow
    from transformers import LlamaConfig

    from draftline.config import FinetuneConfig
    from draftline.train.finetune import record_plan

    verifier = tmp_path / "verifier"
    LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                num_hidden_layers=6, vocab_size=512).save_pretrained(str(verifier))
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    cfg = FinetuneConfig(data=str(tmp_path), gpus=2, zero_stage=3, tokens_per_batch=256)
    with mlflow.start_run() as active:
        record_plan(cfg, 2, True, str(verifier), 128, [1, 3, 4], active.info.run_id)
        record_plan(cfg, 2, True, str(verifier), 128, [1, 3, 4], active.info.run_id)  # a resume: no clash
    got = mlflow.artifacts.load_dict(f"runs:/{active.info.run_id}/plan.json")
    assert got["zero_stage"] == 3 and got["gpus_per_node"] == 2 and got["fits"] is None
    assert got["shape"]["hidden_size"] == 64 and got["shape"]["draft_vocab_size"] == 128
    assert mlflow.get_run(active.info.run_id).data.params["plan.fits"] == "unchecked"


def _kimi_k25_config(tmp_path, hidden=7168):
    """Kimi-K2.5's config.json as it ships: the kimi_k25 wrapper, the language model under text_config."""
    d = tmp_path / "Kimi-K2.5"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
        "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config"},
        "text_config": {"model_type": "kimi_k2", "hidden_size": hidden, "num_hidden_layers": 61,
                        "kv_lora_rank": 512, "q_lora_rank": 1536, "vocab_size": 163840}}))
    return d


def test_the_missions_run_is_planned_from_the_verifiers_own_config(run, tmp_path):
    verifier = _kimi_k25_config(tmp_path)
    r = run("plan", "--samples", "25000", "--tokens-per-sample", "3000", "--verifier", verifier / "config.json",
            "--drafter-layer", "mla")
    assert r.exit_code == 0, r.output
    assert "prepared shards of " in r.stdout and ": 4.3 TB for 25,000 samples x 3,000 tokens" in r.stdout
    assert "57,353 bytes a token" in r.stdout and "interconnect: pcie at 63 GB/s" in r.stdout
    assert all(f"ZeRO-{k}" in r.stdout for k in range(4)) and "95 GiB per GPU" in r.stdout


def test_a_verifier_of_another_width_than_the_drafter_is_refused_in_one_line(run, tmp_path):
    r = run("plan", "--verifier", _kimi_k25_config(tmp_path, hidden=576))
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert [ln for ln in r.stderr.splitlines() if ln.startswith("error:")] == [
        "error: verifier Kimi-K2.5 has hidden size 576, the planned drafter 7168: pass --drafter with a drafter of "
        "that verifier"]
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    r = run("plan", "--verifier", bad)
    assert r.exit_code == 2 and "verifier config" in r.stderr and "is unreadable" in r.stderr


def test_the_real_run_is_planned_phase_by_phase_with_its_nodes_and_disk(run):
    """plan --samples 25000: regeneration, capture, training and evaluation, each with its time, the nodes it needs
    and the disk bandwidth it asks; training reads 8 ranks x 4,096 tokens x 57,353 bytes every step."""
    r = run("plan", "--drafter-layer", "mla", "--samples", "25000", "--epochs", "1", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    phases = {p["name"]: p for p in out["run"]["phases"]}
    assert list(phases) == ["regeneration", "capture", "training", "evaluation"]
    steps = out["run"]["steps"]
    assert steps == -(-25000 * 3000 // (8 * 4096))  # one epoch
    read = 8 * 4096 * out["storage"]["bytes_per_token"]
    assert read == 8 * 4096 * 57353
    training = phases["training"]
    assert training["seconds"] >= steps * read / (3.0 * 1e9) * 0.999  # never faster than the disk reads the shards
    assert training["disk_bound"] is (training["disk_gb_s"] > 3.0)
    assert "second 8-GPU node" in phases["capture"]["nodes"] and "serving node" in phases["regeneration"]["nodes"]
    assert phases["regeneration"]["seconds"] == pytest.approx(25000 * 3000 / 1500)
    assert out["run"]["total_s"] == pytest.approx(sum(p["seconds"] for p in phases.values()))
    twice = json.loads(run("plan", "--drafter-layer", "mla", "--samples", "25000", "--epochs", "2", "--disk-gb-s",
                           "30", "--json").stdout)
    assert twice["run"]["steps"] == -(-2 * 25000 * 3000 // (8 * 4096))
    assert not {p["name"]: p for p in twice["run"]["phases"]}["training"]["disk_bound"]  # a faster disk: the GPUs
    text = run("plan", "--drafter-layer", "mla", "--samples", "25000").stdout
    assert "the run, phase by phase" in text and "capture" in text and "--regenerate-tokens-per-s 1500" in text


def test_plan_takes_the_lengths_measured_on_a_prepared_data_set(run, prepared):
    from draftline.data.shards import open_prepared

    manifest = open_prepared(prepared, verify=False).manifest
    out = json.loads(run("plan", "--data", str(prepared), "--samples", "1000", "--json").stdout)
    assert out["run"]["tokens_per_sample"] == round(manifest["tokens"] / manifest["samples"])
    assert out["run"]["reply_tokens"] == int(manifest["masked_tokens"] / manifest["samples"])
    assert out["storage"]["tokens"] == 1000 * out["run"]["tokens_per_sample"]


def test_epochs_set_the_steps_from_the_data():
    from draftline.config import FinetuneConfig
    from draftline.train.finetune import steps_for_epochs

    cfg = FinetuneConfig(data="x", epochs=2, tokens_per_batch=1000, val_fraction=0.1)
    assert steps_for_epochs(cfg, {"tokens": 100_000}, 4, held_out=False) == 45  # 2 x 90,000 / 4,000
    assert steps_for_epochs(cfg, {"tokens": 100_000}, 4, held_out=True) == 50  # an evaluation set: no share held
    assert steps_for_epochs(cfg.model_copy(update={"epochs": 0.001}), {"tokens": 100}, 8, held_out=True) == 1


# options plan and finetune both have that mean different things there, and why
PLAN_ONLY_MEANING = {
    "--gpus": "GPUs per node of the machines planned for; finetune's counts the ranks it launches here (0: all)",
    "--zero-stage": "plan compares every stage unless told the one you will use; finetune trains with one",
    "--data": "plan measures the prepared data's lengths (optional); finetune trains on it (required)",
}


def _options(command: str) -> dict[str, dict]:
    import click

    ctx = click.Context(cli.commands[command])
    return {p.opts[0]: {"type": type(getattr(p.type, "inner", p.type)).__name__, "default": p.default, "help": p.help,
                        "record": p.get_help_record(ctx)}
            for p in cli.commands[command].params if isinstance(p, click.Option) and not p.hidden}


def test_plan_and_finetune_agree_on_every_option_they_share():
    """plan takes finetune's settings from FinetuneConfig: the same flag, type, bounds, default and help."""
    planned, trained = _options("plan"), _options("finetune")
    shared = sorted(set(planned) & set(trained) - set(PLAN_ONLY_MEANING))
    assert set(shared) >= {"--tokens-per-batch", "--ttt-steps", "--precision", "--attn-impl", "--epochs", "--steps",
                           "--drafter-layer", "--draft-vocab-size"}
    differ = [flag for flag in shared if planned[flag] != trained[flag]]
    assert differ == []


@pytest.mark.parametrize(("flag", "value", "said"), [("--tokens-per-batch", "8", "greater than or equal to 16"),
                                                     ("--ttt-steps", "17", "less than or equal to 16"),
                                                     ("--precision", "fp16", "'fp16' is not one of")])
def test_a_shared_option_is_bounded_as_finetune_bounds_it(flag, value, said):
    out = CliRunner().invoke(cli, ["plan", flag, value])
    assert out.exit_code == 2 and said in out.output and "Traceback" not in out.output


def test_plan_auto_is_what_finetune_resolves_on_gpus_and_its_steps_are_finetunes():
    """The defaults: finetune's auto on GPUs (bf16, sdpa, MLA for the mission's Kimi-K2.5) and its 200 steps."""
    out = json.loads(CliRunner().invoke(cli, ["plan", "--json"]).stdout)
    assert (out["precision"], out["activations"]["attn_impl"]) == ("bf16", "sdpa")
    assert "MLA" in out["drafter"]
    assert out["run"]["steps"] == 200
    epoch = json.loads(CliRunner().invoke(cli, ["plan", "--json", "--epochs", "1"]).stdout)["run"]
    assert epoch["epochs"] == 1 and epoch["steps"] > 200
