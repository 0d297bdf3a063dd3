"""The drafter's decoder layer for verifiers speculators cannot build a layer of (Kimi-K2 is DeepSeek-V3)."""

import json

import pytest
import torch

from draftline.drafter.model import build_draft_model
from draftline.drafter.shape import layer_config


@pytest.fixture(scope="module")
def deepseek_verifier(tmp_path_factory):
    """A tiny DeepSeek-V3 (MLA + MoE) verifier with weights, as Kimi-K2's architecture."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    d = tmp_path_factory.mktemp("deepseek")
    torch.manual_seed(0)
    DeepseekV3ForCausalLM(DeepseekV3Config(
        hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=4, v_head_dim=32, qk_nope_head_dim=32, qk_rope_head_dim=16, q_lora_rank=None,
        vocab_size=1024, num_hidden_layers=8, n_routed_experts=4, num_experts_per_tok=2,
        first_k_dense_replace=1)).save_pretrained(d)
    return str(d)


def _vocab():
    t2d = torch.zeros(1024, dtype=torch.bool)
    t2d[:256] = True
    return torch.zeros(256, dtype=torch.long), t2d


def test_a_deepseek_verifier_gets_the_aq_medai_parents_llama_layer(deepseek_verifier, tmp_path):
    # AQ-MedAI's config.json is a LlamaForCausalLMEagle3 layer with head_dim 128 for a hidden size of 7168;
    # here the same idea at the tiny scale: head_dim 40 != hidden / heads
    parent = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 128,
              "intermediate_size": 320, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 40,
              "rope_theta": 1e6, "draft_vocab_size": 256, "vocab_size": 1024}
    layer = layer_config(deepseek_verifier, parent)
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1 and layer["head_dim"] == 40
    d2t, t2d = _vocab()
    model = build_draft_model(deepseek_verifier, d2t=d2t, t2d=t2d, aux_layer_ids=[2, 4, 5], draft_vocab_size=256,
                              dtype=torch.float32, layer=layer)
    assert model.layers[0].self_attn.q_proj.weight.shape == (160, 256)  # 4 heads x 40, 2 x hidden in
    assert model.layers[0].mlp.up_proj.weight.shape == (320, 128)
    model.save_pretrained(str(tmp_path / "out"))  # and it saves as a Llama-layer speculators drafter (vLLM)
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["transformer_layer_config"]["model_type"] == "llama"


def test_without_a_parent_a_llama_layer_is_derived_from_the_verifiers_sizes(deepseek_verifier):
    layer = layer_config(deepseek_verifier, None, "llama")
    assert layer["model_type"] == "llama"
    assert (layer["hidden_size"], layer["num_attention_heads"], layer["head_dim"]) == (128, 4, 32)  # v_head_dim
    assert layer["intermediate_size"] == 256 and layer["vocab_size"] == 1024
    d2t, t2d = _vocab()
    model = build_draft_model(deepseek_verifier, d2t=d2t, t2d=t2d, aux_layer_ids=[2, 4, 5], draft_vocab_size=256,
                              dtype=torch.float32, layer=layer)
    out = model(input_ids=torch.randint(0, 1024, (1, 8)), hidden_states=torch.randn(1, 8, 3 * 128),
                document_ids=torch.zeros(1, 8, dtype=torch.long), position_ids=torch.arange(8)[None], ttt_steps=2)
    assert len(out) > 0 and torch.isfinite(out[0][0]).all()
