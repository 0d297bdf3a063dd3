"""export --layout midlayer writes SpecForge's config from the drafter's own layer (head_dim 128 and rope base
1e6 at the AQ-MedAI shape, not the verifier's hidden / heads = 112 and 10000) and is validated by reading it
back through the parent-loading path: init=<that directory> gets bit-identical weights."""

import json
import time

import pytest
import torch

from benchmarks.common import AUX, SHAPES
from draftline import names
from draftline.drafter.form import EagleForm, with_form
from draftline.drafter.shape import layer_config, verifier_config
from draftline.errors import CheckpointError
from draftline.export.midlayer import check_reload, write_midlayer

LAYER_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "rope_theta", "rms_norm_eps", "max_position_embeddings", "vocab_size", "draft_vocab_size")


def _verifier(root, s):
    """A Kimi-K2-like (DeepSeek-V3) verifier's config.json at shape ``s``: its hidden / heads is not the
    drafter's head_dim, its rope base not the drafter's."""
    from transformers import DeepseekV3Config

    DeepseekV3Config(hidden_size=s["hidden_size"], vocab_size=s["vocab_size"], num_hidden_layers=61,
                     num_attention_heads=s["num_attention_heads"], num_key_value_heads=s["num_attention_heads"],
                     v_head_dim=s["head_dim"], intermediate_size=s["intermediate_size"],
                     architectures=["DeepseekV3ForCausalLM"]).save_pretrained(root)
    return str(root)


def _drafter(verifier, s, form=EagleForm()):
    """A drafter of shape ``s`` in EAGLE ``form`` with random bf16 weights; the verifier-owned tensors (embeddings,
    verifier head) stay on the meta device, since no layout writes them."""
    from speculators.models.eagle3 import Eagle3DraftModel

    parent_cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLMEagle3"],
                  **{k: s[k] for k in LAYER_KEYS}}
    layer = with_form(layer_config(verifier, parent_cfg), form)
    config = verifier_config(verifier, draft_vocab_size=s["draft_vocab_size"], aux_layer_ids=AUX, layer=layer)
    config.transformer_layer_config._attn_implementation = "sdpa"
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = Eagle3DraftModel(config)
    finally:
        torch.set_default_dtype(previous)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name in ("layers", "fc", "norm", "lm_head", *(("fc_norm",) if form.fc_norm else ())):
            module = getattr(model, name).to_empty(device="cpu")
            for p in module.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype) * 0.02)
        n, v = s["draft_vocab_size"], s["vocab_size"]
        ids = torch.arange(n) * (v // n)
        t2d = torch.zeros(v, dtype=torch.bool)
        t2d[ids] = True
        model.d2t, model.t2d = ids - torch.arange(n), t2d
    return model


def test_the_midlayer_export_round_trips_bit_identically_through_the_parent_loading_path(tmp_path):
    round_trip("tiny", tmp_path)  # the real shape: tests/integration/test_export_midlayer_real.py


def round_trip(shape: str, tmp_path) -> None:
    """Export at ``shape``, read it back through the parent-loading path, and refuse the config the old export
    wrote."""
    s = SHAPES[shape]
    verifier = _verifier(tmp_path / "verifier", s)
    t0 = time.perf_counter()
    model = _drafter(verifier, s)
    built = time.perf_counter()
    out = tmp_path / "midlayer"
    write_midlayer(model, out, {names.VERIFIER_AUX_LAYERS: json.dumps(AUX)})
    written = time.perf_counter()
    report = check_reload(model, out, verifier)
    checked = time.perf_counter()
    print(f"{shape}: build {built - t0:.1f} s, write {written - built:.1f} s "
          f"({(out / 'model.safetensors').stat().st_size / 1e9:.2f} GB), reload check {checked - written:.1f} s, "
          f"{report['tensors']} tensors bit-identical")
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["head_dim"], cfg["rope_theta"]) == (s["head_dim"], s["rope_theta"])
    assert cfg["hidden_size"] // cfg["num_attention_heads"] != cfg["head_dim"] or shape == "tiny"
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == AUX
    assert report["tensors"] == 15  # 10 layer tensors, fc, norm, lm_head, d2t, t2d

    # the config the old export wrote (head_dim from the verifier's hidden / heads, rope base 10000) is refused
    cfg.update(head_dim=s["hidden_size"] // s["num_attention_heads"], rope_theta=10000.0)
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="describes another layer") as e:
        check_reload(model, out, verifier)
    assert "rope_theta 10000.0 (drafter 1000000.0)" in str(e.value)
    if shape == "real":
        assert "head_dim 112 (drafter 128)" in str(e.value)


def test_an_eagle_31_drafter_round_trips_with_its_norms_and_says_its_form(tmp_path):
    """SpecForge's layout of a 3.1 drafter: its fc_norm.{i}.weight and both switches in its config, read back as
    finetune reads init=<that directory>, in its form."""
    s = SHAPES["tiny"]
    verifier = _verifier(tmp_path / "verifier", s)
    model = _drafter(verifier, s, EagleForm(fc_norm=True, norm_output=True))
    out = tmp_path / "midlayer"
    write_midlayer(model, out, {names.VERIFIER_AUX_LAYERS: json.dumps(AUX)})
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["fc_norm"], cfg["norm_output"], cfg["norm_before_residual"]) == (True, True, False)
    assert check_reload(model, out, verifier)["tensors"] == 15 + len(AUX)  # and one norm per aux layer
