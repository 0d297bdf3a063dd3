"""The MLA drafter layer: one DeepSeek-V3 multi-head latent attention decoder layer with a dense MLP, the EAGLE-3
layer vLLM serves as ``Eagle3DeepseekV2ForCausalLM`` (``vllm/model_executor/models/deepseek_eagle3.py``) and the
field serves for Kimi-K2.5 (lightseekorg/kimi-k2.5-eagle3-mla).

speculators 0.9's ``Eagle3DraftModel`` builds its decoder layers from a plain dict keyed by the layer config's
``model_type`` (``speculators.models.eagle3.model_definitions.model_classes``: ``llama``, ``qwen3``). Importing this
module adds ``deepseek_v3`` to it from transformers' own ``DeepseekV3Attention``/``DeepseekV3MLP``, with the first
layer made EAGLE-3's as speculators makes its Llama one (its ``Eagle3FirstLayerMixin``: ``cat(input_layernorm(
embeds), hidden_norm(hidden))`` into the attention, the residual the hidden part), so the same TTT steps, loss,
pairing, walk, ZeRO stages and checkpoints train it. What differs is only the attention's input projections: MLA
reads the 2 x hidden input through ``q_a_proj`` (``q_proj`` without a query LoRA) and ``kv_a_proj_with_mqa``,
exactly the two vLLM widens. The parameter names are vLLM's (``self_attn.q_a_proj``, ``q_a_layernorm``,
``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``; ``mlp.{gate,up,down}_proj``).
"""

from __future__ import annotations

import torch
from speculators.models import base_components
from speculators.models.eagle3 import model_definitions
from speculators.models.eagle3.model_definitions import Eagle3FirstLayerMixin
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3DecoderLayer,
    DeepseekV3MLP,
    DeepseekV3RMSNorm,
    DeepseekV3RotaryEmbedding,
)

from draftline.kinds import MLA

__all__ = ["MLA_FIELDS", "MLA_MODEL_TYPE", "SERVED_MODEL_TYPE", "VLLM_ARCHITECTURE", "DenseDeepseekV3DecoderLayer",
           "DeepseekV3Eagle3FirstLayer", "is_mla_config", "layer_config_object", "mla_dims"]

MLA_MODEL_TYPE = "deepseek_v3"  # the layer config's model_type in memory (transformers' DeepseekV3Config)
# What an exported MLA drafter's config.json says. vLLM maps ``kimi_k2`` to DeepseekV3Config; a drafter saying
# ``deepseek_v3`` is rewritten by vLLM's SpeculativeConfig.hf_config_override into DeepSeekMTPModel and refused.
SERVED_MODEL_TYPE = "kimi_k2"
VLLM_ARCHITECTURE = MLA.vllm_architecture
# The fields of a DeepSeek-V3 config that describe the drafter's one MLA layer.
MLA_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "q_lora_rank",
              "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rms_norm_eps",
              "max_position_embeddings", "hidden_act", "attention_bias", "rope_interleave", "rope_parameters",
              "rope_scaling", "rope_theta")
DIMS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def is_mla_config(config: dict | None) -> bool:
    """Whether a config dict (a layer config, a flat SpecForge/lightseek one, or a speculators one) describes an
    MLA layer."""
    if not config:
        return False
    tl = config.get("transformer_layer_config")
    layer: dict = tl if isinstance(tl, dict) else config
    return layer.get("kv_lora_rank") is not None or layer.get("model_type") == MLA_MODEL_TYPE


def mla_dims(config) -> dict[str, int | None]:
    """The MLA dimensions vLLM's MLA backend must share between verifier and drafter (a config object or dict)."""
    get = config.get if isinstance(config, dict) else (lambda k: getattr(config, k, None))
    return {k: get(k) for k in (*DIMS, "q_lora_rank")}


def layer_config_object(fields: dict) -> DeepseekV3Config:
    """transformers' config of the drafter's one MLA layer from its fields (dense: no experts in layer 0)."""
    fields = {k: v for k, v in fields.items() if k not in ("model_type", "num_hidden_layers", "first_k_dense_replace")}
    return DeepseekV3Config(**fields, num_hidden_layers=1, first_k_dense_replace=1)


class DenseDeepseekV3DecoderLayer(DeepseekV3DecoderLayer):
    """A DeepSeek-V3 decoder layer whose MLP is always dense (EAGLE-3 drafters have no experts, as vLLM's)."""

    def __init__(self, config: DeepseekV3Config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.mlp = DeepseekV3MLP(config)  # type: ignore[assignment]


class DeepseekV3Eagle3FirstLayer(Eagle3FirstLayerMixin, DenseDeepseekV3DecoderLayer):  # type: ignore[misc]
    """EAGLE-3's first layer on MLA: the attention's input projections read ``cat(embeds, hidden)`` (2 x hidden),
    with ``hidden_norm`` on the hidden half (speculators' mixin does the split, the norms and the residual)."""

    def __init__(self, config: DeepseekV3Config, layer_idx: int, norm_before_residual: bool = False):
        super().__init__(config, layer_idx)
        self.norm_before_residual = norm_before_residual
        self.hidden_norm = DeepseekV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        attn, wide = self.self_attn, 2 * config.hidden_size
        if attn.q_lora_rank is None:
            attn.q_proj = torch.nn.Linear(wide, attn.num_heads * attn.qk_head_dim, bias=False)
        else:
            attn.q_a_proj = torch.nn.Linear(wide, attn.q_lora_rank, bias=config.attention_bias)
        attn.kv_a_proj_with_mqa = torch.nn.Linear(wide, config.kv_lora_rank + config.qk_rope_head_dim,
                                                  bias=config.attention_bias)


model_definitions.model_classes[MLA_MODEL_TYPE] = base_components.ModelComponents(
    first_layer_class=DeepseekV3Eagle3FirstLayer, decoder_layer_class=DenseDeepseekV3DecoderLayer,
    norm_class=DeepseekV3RMSNorm, rotary_emb_class=DeepseekV3RotaryEmbedding)
