"""The MLA drafter layer (one DeepSeek-V3 MLA decoder layer with a dense MLP, vLLM's Eagle3DeepseekV2ForCausalLM):
chosen by one setting, built with vLLM's parameter names and widths, trained by the same loss with the blockwise
draft attention equal to sdpa, and written in the flat form vLLM loads (read back strictly as a parent)."""

import json

import pytest
import torch
from click.testing import CliRunner

from benchmarks.common import bench_model, drafter_config
from draftline.cli import cli
from draftline.drafter import attention
from draftline.drafter.checkpoints import find_checkpoint, read_header
from draftline.drafter.loading import load_drafter
from draftline.drafter.model import build_draft_model, forward, pack
from draftline.drafter.served import is_mla_drafter, save_served, short_form
from draftline.drafter.shape import layer_config, layer_kind, load_config
from draftline.errors import ConfigError, ParentMismatch

HIDDEN, VOCAB, DRAFT = 128, 1024, 256


@pytest.fixture(scope="module")
def deepseek_verifier(tmp_path_factory):
    """A tiny DeepSeek-V3 (MLA + MoE) verifier with DeepSeek's head dims and a query LoRA, as Kimi's."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    d = tmp_path_factory.mktemp("deepseek-mla")
    torch.manual_seed(0)
    DeepseekV3ForCausalLM(DeepseekV3Config(
        hidden_size=HIDDEN, intermediate_size=256, moe_intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, vocab_size=VOCAB, num_hidden_layers=6, n_routed_experts=4, num_experts_per_tok=2,
        first_k_dense_replace=1)).save_pretrained(d)
    return str(d)


@pytest.fixture(scope="module")
def llama_verifier(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("llama")
    LlamaForCausalLM(LlamaConfig(hidden_size=HIDDEN, intermediate_size=256, num_attention_heads=4,
                                 num_key_value_heads=2, num_hidden_layers=6, vocab_size=VOCAB)).save_pretrained(d)
    return str(d)


def _vocab():
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[:DRAFT] = True
    return torch.zeros(DRAFT, dtype=torch.long), t2d


def _mla_drafter(verifier, seed=0):
    torch.manual_seed(seed)
    d2t, t2d = _vocab()
    return build_draft_model(verifier, d2t=d2t, t2d=t2d, aux_layer_ids=[1, 3, 4], draft_vocab_size=DRAFT,
                             dtype=torch.float32, layer=layer_config(verifier, None, "mla"))


def test_random_init_on_an_mla_verifier_picks_mla_and_llama_elsewhere(deepseek_verifier, llama_verifier):
    assert layer_kind(layer_config(deepseek_verifier)) == "mla"
    assert layer_kind(layer_config(llama_verifier)) == "llama"
    assert layer_kind(layer_config(deepseek_verifier, None, "llama")) == "llama"


def test_the_mla_layer_has_vllms_names_and_widths(deepseek_verifier):
    model = _mla_drafter(deepseek_verifier)
    attn = model.layers[0].self_attn
    # the first layer reads cat(embeds, hidden): the two input projections vLLM widens take 2 x hidden
    assert attn.q_a_proj.weight.shape == (64, 2 * HIDDEN)
    assert attn.kv_a_proj_with_mqa.weight.shape == (512 + 64, 2 * HIDDEN)
    assert attn.kv_b_proj.weight.shape == (4 * (128 + 128), 512)
    assert attn.o_proj.weight.shape == (HIDDEN, 4 * 128)
    names = {n for n, _ in model.named_parameters()}
    assert {"layers.0.hidden_norm.weight", "layers.0.mlp.gate_proj.weight", "layers.0.self_attn.q_a_layernorm.weight",
            "layers.0.self_attn.kv_a_layernorm.weight", "fc.weight"} <= names
    assert not any("experts" in n for n in names)  # a dense MLP, as vLLM builds it
    assert is_mla_drafter(model)


def _batch(model, lengths, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h, aux = model.hidden_size, len(model.config.eagle_aux_hidden_state_layer_ids)
    return pack([{"input_ids": torch.randint(0, model.verifier_vocab_size, (n,), generator=g),
                  "loss_mask": torch.arange(n) >= n // 3,
                  "hidden_states": torch.randn(n, aux * h, generator=g).to(dtype),
                  "verifier_last_hidden_states": torch.randn(n, h, generator=g).to(dtype)} for n in lengths])


def _train_once(attn):
    torch.manual_seed(0)
    model = bench_model("tiny-mla", "cpu", dtype=torch.float32, attn=attn)
    loss, metrics = forward(model, _batch(model, [7, 40, 1, 23], torch.float32), ttt_steps=3)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_blockwise_draft_attention_equals_sdpa_on_the_mla_layer():
    want_loss, want = _train_once("sdpa")
    got_loss, got = _train_once(attention.NAME)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=0)
    assert got.keys() == want.keys() and any("kv_b_proj" in n for n in got)
    for name in want:
        err = (got[name] - want[name]).norm() / want[name].norm().clamp_min(1e-30)
        assert err < 1e-5, f"{name}: relative error {err:.2e}"


def test_the_export_is_vllms_flat_form_and_reads_back_strictly(deepseek_verifier, tmp_path):
    model = _mla_drafter(deepseek_verifier).to(torch.bfloat16)
    out = save_served(model, tmp_path / "mla", "org/verifier")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and cfg["model_type"] == "kimi_k2"
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4] and not short_form(cfg)
    assert (cfg["q_lora_rank"], cfg["kv_lora_rank"], cfg["draft_vocab_size"]) == (64, 512, DRAFT)
    header = read_header(find_checkpoint(out))
    assert "midlayer.self_attn.kv_a_proj_with_mqa.weight" in header and "embed_tokens.weight" not in header
    assert {"d2t", "t2d", "fc.weight", "lm_head.weight"} <= set(header)
    reloaded = load_drafter(deepseek_verifier, out, aux_layer_ids=[1, 3, 4], dtype=torch.bfloat16)
    ours = model.state_dict()
    for key, value in reloaded.state_dict().items():
        if key in ours and not key.startswith(("embed_tokens", "verifier_lm_head")):
            assert torch.equal(value, ours[key]), key
    assert load_config(out).transformer_layer_config.kv_lora_rank == 512


def test_mla_on_a_verifier_without_mla_is_refused(llama_verifier):
    with pytest.raises(ConfigError, match="has no MLA attention"):
        layer_config(llama_verifier, None, "mla")


def test_a_parents_layer_decides_and_a_contrary_setting_is_refused(deepseek_verifier, tmp_path):
    out = save_served(_mla_drafter(deepseek_verifier).to(torch.bfloat16), tmp_path / "p", "org/verifier")
    parent = json.loads((out / "config.json").read_text())
    assert layer_kind(layer_config(deepseek_verifier, parent)) == "mla"
    with pytest.raises(ParentMismatch, match="--drafter-layer mla"):
        layer_config(deepseek_verifier, parent, "llama")
    for dim in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):  # each of the verifier's
        wrong = {**parent, dim: parent[dim] * 2}
        with pytest.raises(ParentMismatch, match=f"{dim} {parent[dim] * 2}"):
            layer_config(deepseek_verifier, wrong)
    with pytest.raises(ParentMismatch, match="model_type 'deepseek_v3'"):
        layer_config(deepseek_verifier, {**parent, "model_type": "deepseek_v3"})


def test_a_full_vocabulary_parent_without_d2t_loads_as_identity(deepseek_verifier, tmp_path):
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    full = build_draft_model(deepseek_verifier, d2t=torch.zeros(VOCAB, dtype=torch.long),
                             t2d=torch.ones(VOCAB, dtype=torch.bool), aux_layer_ids=[1, 3, 4],
                             draft_vocab_size=VOCAB, dtype=torch.float32,
                             layer=layer_config(deepseek_verifier, None, "mla")).to(torch.bfloat16)
    out = save_served(full, tmp_path / "full", "org/verifier")
    weights = load_file(out / "model.safetensors")
    save_file({k: v for k, v in weights.items() if k not in ("d2t", "t2d")}, out / "model.safetensors")
    reloaded = load_drafter(deepseek_verifier, out, dtype=torch.bfloat16)
    assert reloaded.draft_vocab_size == VOCAB  # speculators keeps no map for a whole vocabulary: row i is token i
    assert reloaded.t2d is None or bool(reloaded.t2d.all())
    assert torch.equal(reloaded.lm_head.weight, full.lm_head.weight)


def test_an_unknown_layer_setting_is_refused_in_one_line():
    r = CliRunner().invoke(cli, ["finetune", "--data", "x", "--drafter-layer", "gru"])
    assert r.exit_code == 2 and "'--drafter-layer': 'gru' is not one of" in r.output and "'mla'" in r.output
    assert "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1


def test_the_real_mla_shape_is_lightseeks():
    config = drafter_config("real-mla")
    layer = config.transformer_layer_config
    assert (layer.hidden_size, layer.num_attention_heads, layer.q_lora_rank, layer.kv_lora_rank) == (7168, 64, 1536,
                                                                                                      512)
    assert layer.rope_parameters["rope_type"] == "yarn" and config.draft_vocab_size == 163840


def test_the_kimi_k25_mla_catalog_parent_loads_strictly_from_a_hub_cache(deepseek_verifier, tmp_path, monkeypatch):
    """init=kimi-k25-mla offline, from a Hugging Face cache laid out as the hub lays it
    (models--lightseekorg--kimi-k2.5-eagle3-mla), read strictly into the drafter finetune would train."""
    from draftline.drafter.parents import load_catalog, resolve_init
    from tests.unit.drafter.test_parents import hub_snapshot

    model = _mla_drafter(deepseek_verifier, seed=3).to(torch.bfloat16)
    out = save_served(model, tmp_path / "made", "org/verifier")
    entry = load_catalog()["kimi-k25-mla"]
    assert entry.source == "lightseekorg/kimi-k2.5-eagle3-mla" and entry.layout == "midlayer"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("DRAFTLINE_PARENTS_DIR", raising=False)
    snap = hub_snapshot(tmp_path / "hub", entry.source, {f.name: f.read_bytes() for f in out.iterdir()},
                        ref=entry.revision)
    parent = resolve_init("kimi-k25-mla")
    assert parent.path == snap
    loaded = load_drafter(deepseek_verifier, parent.path, dtype=torch.bfloat16)
    assert is_mla_drafter(loaded)
    assert torch.equal(loaded.layers[0].self_attn.kv_a_proj_with_mqa.weight,
                       model.layers[0].self_attn.kv_a_proj_with_mqa.weight)


def test_mla_for_a_llama_verifiers_data_is_one_line_exit_2_and_no_run(workspace, prepared):
    """The command a user types: the tiny (Llama) verifier's data with --drafter-layer mla."""
    from mlflow import MlflowClient

    r = CliRunner().invoke(cli, ["finetune", "--data", str(prepared), "--init", "random", "--drafter-layer", "mla",
                                 "--steps", "1"])
    errors = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert r.exit_code == 2 and len(errors) == 1 and "has no MLA attention" in errors[0], r.output
    assert "--drafter-layer" in errors[0] and "Traceback" not in r.output
    client = MlflowClient()
    assert not client.search_runs([e.experiment_id for e in client.search_experiments()])


def modelopt_layout(out, aux_sglang: list[int], *, lm_head: bool = True):
    """A served MLA drafter rewritten as NVIDIA Model-Optimizer exports one for Kimi (``eagle_decoder_type``
    kimik2; ``hf_spec_export.py``): ``layers.0.*`` keys, the whole vocabulary without ``d2t``/``t2d`` or
    ``draft_vocab_size``, the ids under ``eagle_config`` only, in ModelOpt's count (the output of layer i), and
    no convention, form or aux-count fields."""
    from safetensors.torch import load_file, save_file

    config = json.loads((out / "config.json").read_text())
    for key in ("eagle_aux_hidden_state_layer_ids", "num_aux_hidden_states", "aux_layer_convention",
                "draft_vocab_size", "fc_norm", "norm_output", "norm_before_residual"):
        config.pop(key, None)
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_sglang, "use_aux_hidden_state": True,
                              "use_last_layernorm": True, "next_layer_regular": True}
    (out / "config.json").write_text(json.dumps(config))
    weights = {k.replace("midlayer.", "layers.0.", 1): v for k, v in load_file(out / "model.safetensors").items()
               if k not in ("d2t", "t2d") and (lm_head or k != "lm_head.weight")}
    save_file(weights, out / "model.safetensors")
    return out


@pytest.mark.parametrize("head", [True, False], ids=["own-head", "verifier-head"])
def test_nvidias_kimi_k26_catalog_parent_loads_strictly_with_its_ids_read_as_modelopt_meant(
        deepseek_verifier, tmp_path, monkeypatch, head):
    """init=kimi-k26-nvidia offline, from a hub cache: ModelOpt's layout (``layers.0.*``, whole vocabulary, ids
    nested) loads strictly, and its ids, which name layer outputs, are captured by vLLM one layer up. Without an
    ``lm_head`` (a copy that ships none drafts through the verifier's in vLLM) the drafter starts from the
    verifier's head."""
    from draftline.drafter.parents import aux_reads, load_catalog, resolve_init
    from tests.unit.drafter.test_parents import hub_snapshot

    torch.manual_seed(4)
    full = build_draft_model(deepseek_verifier, d2t=torch.zeros(VOCAB, dtype=torch.long),
                             t2d=torch.ones(VOCAB, dtype=torch.bool), aux_layer_ids=[1, 3, 4],
                             draft_vocab_size=VOCAB, dtype=torch.float32,
                             layer=layer_config(deepseek_verifier, None, "mla")).to(torch.bfloat16)
    with torch.no_grad():
        full.lm_head.weight.add_(0.5)  # trained: not the verifier's head it was built from
    out = modelopt_layout(save_served(full, tmp_path / "made", "org/verifier"), [0, 2, 3], lm_head=head)
    entry = load_catalog()["kimi-k26-nvidia"]
    assert (entry.source, entry.layout, entry.aux_convention) == ("nvidia/Kimi-K2.6-Eagle3", "speculators", "sglang")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("DRAFTLINE_PARENTS_DIR", raising=False)
    hub_snapshot(tmp_path / "hub", entry.source, {f.name: f.read_bytes() for f in out.iterdir()}, ref=entry.revision)
    parent = resolve_init("kimi-k26-nvidia")
    files = find_checkpoint(parent.path)
    assert aux_reads(parent, files.config, "auto", 6) == ("sglang", [1, 3, 4])  # outputs of 0, 2, 3: vLLM's 1, 3, 4
    assert layer_kind(layer_config(deepseek_verifier, files.config)) == "mla"
    loaded = load_drafter(deepseek_verifier, parent.path, aux_layer_ids=[0, 2, 3], dtype=torch.bfloat16)
    assert is_mla_drafter(loaded) and loaded.draft_vocab_size == VOCAB and not loaded.config.fc_norm
    assert torch.equal(loaded.layers[0].self_attn.q_a_proj.weight, full.layers[0].self_attn.q_a_proj.weight)
    if head:
        assert torch.equal(loaded.lm_head.weight, full.lm_head.weight)
    else:
        from safetensors.torch import load_file

        verifier = load_file(f"{deepseek_verifier}/model.safetensors")["lm_head.weight"]
        assert torch.equal(loaded.lm_head.weight, verifier.to(torch.bfloat16))
        assert not torch.equal(loaded.lm_head.weight, full.lm_head.weight)
