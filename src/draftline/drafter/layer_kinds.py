"""The kinds of decoder layer a drafter can have, each one class in one registry (as speculators registers its
model classes by name): how the kind's layer config is made from a verifier and a parent, what it asks of them,
how a drafter config is built from flat fields, the config.json vLLM serves it from, the real Kimi drafter of that
kind and what its attention costs in the plan. Every other module asks the registry (``named``, ``of_layer``,
``of_parent``) instead of comparing a kind's name.

The EAGLE form (3.0, or 3.1: ``fc_norm``, ``norm_output``; :mod:`draftline.drafter.form`) is orthogonal: every kind
takes either, and every builder here takes the form. What vLLM serves a kind as (its architecture, the dtype of
the verifier beside it) is :mod:`draftline.kinds`, light enough for a serving host.
"""

from __future__ import annotations

from typing import Any, ClassVar

from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.models.eagle3 import Eagle3SpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig
from transformers import LlamaConfig

from draftline import kinds
from draftline.drafter import mla
from draftline.drafter.aux_ids import served_aux_fields
from draftline.drafter.form import EagleForm
from draftline.errors import ConfigError, ParentMismatch

__all__ = ["KIMI_K2", "KIMI_K25_MLA", "LAYERS", "VERIFIER_ONLY_KEYS", "DrafterLayer", "LlamaLayer", "MlaLayer",
           "for_verifier", "named", "of_layer", "of_parent", "speculator_config"]

SUPPORTED_LAYERS = ("llama", "qwen3")  # the verifier layers speculators' Eagle3DraftModel builds as they are
LLAMA_LAYER_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                    "rms_norm_eps", "max_position_embeddings", "hidden_act", "attention_bias", "rope_theta",
                    "rope_scaling", "rope_parameters")
# What a verifier's config.json carries that is not its decoder layer's: identity, the head and, above all,
# quantization. vLLM loads a drafter layer whose config has a ``quantization_config`` as quantized (and refuses it:
# "Unknown quantization method"); production verifiers mostly ship one (FP8 block-quantized Kimi-K2/DeepSeek-V3,
# compressed-tensors INT4 Kimi-K2.5), so the drafter must never inherit it.
VERIFIER_ONLY_KEYS = ("_name_or_path", "architectures", "transformers_version", "auto_map", "id2label", "label2id",
                      "problem_type", "quantization_config", "compression_config", "tokenizer_class")

# The AQ-MedAI/Kimi-K2-Instruct-eagle3 drafter as its config.json describes it (docs/design.md): one Llama layer.
KIMI_K2: dict[str, Any] = {
    "hidden_size": 7168, "intermediate_size": 18432, "num_attention_heads": 64, "num_key_value_heads": 64,
    "head_dim": 128, "vocab_size": 163840, "draft_vocab_size": 32000, "aux_layer_ids": [2, 30, 58],
    "rope_theta": 1e6, "rms_norm_eps": 1e-5, "max_position_embeddings": 8192,
}
# lightseekorg/kimi-k2.5-eagle3-mla as its config.json describes it: one MLA layer, the full vocabulary as its draft
# vocabulary (no reduced one), yarn rope.
KIMI_K25_MLA: dict[str, Any] = {
    "hidden_size": 7168, "intermediate_size": 18432, "num_attention_heads": 64, "num_key_value_heads": 64,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "vocab_size": 163840, "draft_vocab_size": 163840, "aux_layer_ids": [1, 29, 57], "rms_norm_eps": 1e-6,
    "max_position_embeddings": 262144, "hidden_act": "silu",
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 64.0,
                        "original_max_position_embeddings": 4096, "beta_fast": 1.0, "beta_slow": 1.0,
                        "mscale": 1.0, "mscale_all_dim": 1.0},
}

LAYERS: dict[str, type[DrafterLayer]] = {}


def _register(cls: type[DrafterLayer]) -> type[DrafterLayer]:
    LAYERS[cls.served.name] = cls
    return cls


def speculator_config(layer_config, *, draft_vocab_size: int, aux_layer_ids: list[int] | None,
                      verifier: str | None = None, architectures: list[str] | None = None,
                      norm_before_residual: bool = False, form: EagleForm = EagleForm()):
    """An ``Eagle3SpeculatorConfig`` around a transformer layer config (as ``from_training_args`` builds it,
    without reading the verifier), in the EAGLE ``form``."""
    return Eagle3SpeculatorConfig(
        transformer_layer_config=layer_config, draft_vocab_size=draft_vocab_size,
        norm_before_residual=norm_before_residual, fc_norm=form.fc_norm, norm_output=form.norm_output,
        eagle_aux_hidden_state_layer_ids=list(aux_layer_ids) if aux_layer_ids else None,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=verifier, architectures=list(architectures or []))))


def layer_dict(config: dict | None) -> dict:
    """The layer part of a parent's config: speculators' ``transformer_layer_config``, else the flat config."""
    config = config or {}
    tl = config.get("transformer_layer_config")
    return tl if isinstance(tl, dict) else config


class DrafterLayer:
    """One kind of drafter decoder layer. Subclasses are registered in :data:`LAYERS` by their served name."""

    served: ClassVar[kinds.LayerKind]  # what vLLM serves it as (architecture, the verifier's dtype beside it)
    reference: ClassVar[dict[str, Any]]  # the real Kimi drafter of this kind, as its config.json describes it
    reference_name: ClassVar[str]
    unequal_heads: ClassVar[bool] = False  # plan: query/key heads wider than value heads (CPU sdpa's math path)

    @classmethod
    def whole_vocabulary(cls) -> bool:
        """Whether the published drafter of this kind drafts the verifier's whole vocabulary (no ``d2t``/``t2d``)."""
        return cls.reference["draft_vocab_size"] == cls.reference["vocab_size"]

    @classmethod
    def describes(cls, config: dict | None) -> bool:
        """Whether a parent's config (speculators', SpecForge's or vLLM's flat one) has a layer of this kind."""
        raise NotImplementedError

    @classmethod
    def fields(cls, verifier, parent_config: dict | None) -> dict:
        """This kind's layer config for ``verifier`` (a transformers config), the parent's sizes where it has them."""
        raise NotImplementedError

    @classmethod
    def check(cls, verifier, parent_config: dict | None, where: str) -> None:
        """Refuse (exit 2) a verifier or a parent this kind cannot be served beside or loaded from."""

    @classmethod
    def drafter_config(cls, fields: dict[str, Any], *, draft_vocab_size: int, aux_layer_ids: list[int] | None,
                       norm_before_residual: bool = False, form: EagleForm = EagleForm()):
        """A speculators config with one layer of this kind from flat fields (a parent's config.json, or
        :attr:`reference`)."""
        raise NotImplementedError

    @classmethod
    def served_config(cls, model) -> dict | None:
        """The flat ``config.json`` vLLM serves this kind from, or None: speculators' format serves it."""
        return None


@_register
class LlamaLayer(DrafterLayer):
    """The Llama family: a Llama/Qwen3 verifier's own layer, as EAGLE-3 prescribes, else a Llama layer (the
    parent's where it says what it is, else one from the verifier's sizes). AQ-MedAI's Kimi-K2 drafter."""

    served = kinds.LLAMA
    reference = KIMI_K2
    reference_name = "Kimi-K2 EAGLE-3 (AQ-MedAI shape)"

    @classmethod
    def describes(cls, config: dict | None) -> bool:
        return not mla.is_mla_config(config) and cls._parent_fields(config) is not None

    @staticmethod
    def _parent_fields(config: dict | None) -> dict | None:
        if not config:
            return None
        if isinstance(config.get("transformer_layer_config"), dict):  # speculators layout
            return config["transformer_layer_config"]
        if config.get("model_type") == "llama" and config.get("hidden_size"):  # SpecForge / AQ-MedAI layout
            return config
        return None

    @classmethod
    def fields(cls, verifier, parent_config: dict | None) -> dict:
        if verifier.model_type in SUPPORTED_LAYERS:
            return decoder_layer_fields(verifier)
        fields = cls._parent_fields(parent_config) or {
            "hidden_size": verifier.hidden_size, "intermediate_size": verifier.intermediate_size,
            "num_attention_heads": verifier.num_attention_heads,
            "num_key_value_heads": verifier.num_attention_heads,
            "head_dim": getattr(verifier, "v_head_dim", None) or verifier.hidden_size // verifier.num_attention_heads,
            "rms_norm_eps": verifier.rms_norm_eps, "max_position_embeddings": verifier.max_position_embeddings,
            "hidden_act": "silu", "rope_parameters": getattr(verifier, "rope_parameters", None)}
        return {"model_type": "llama", **{k: v for k, v in fields.items() if k in LLAMA_LAYER_KEYS and v is not None}}

    @classmethod
    def drafter_config(cls, fields: dict[str, Any], *, draft_vocab_size: int, aux_layer_ids: list[int] | None,
                       norm_before_residual: bool = False, form: EagleForm = EagleForm()):
        keys = (*LLAMA_LAYER_KEYS, "vocab_size")
        layer = LlamaConfig(**{k: v for k, v in fields.items() if k in keys and v is not None}, num_hidden_layers=1)
        return speculator_config(layer, draft_vocab_size=draft_vocab_size, aux_layer_ids=aux_layer_ids,
                                 norm_before_residual=norm_before_residual, form=form)


@_register
class MlaLayer(DrafterLayer):
    """DeepSeek-V3's MLA layer with a dense MLP (:mod:`draftline.drafter.mla`), served only beside an MLA verifier
    and with its MLA dims. lightseekorg's Kimi-K2.5 drafter; vLLM serves it from its own flat config."""

    served = kinds.MLA
    reference = KIMI_K25_MLA
    reference_name = "Kimi-K2.5 EAGLE-3 MLA (lightseekorg/kimi-k2.5-eagle3-mla shape)"
    unequal_heads = True  # nope + rope query/key heads, narrower value heads

    @classmethod
    def describes(cls, config: dict | None) -> bool:
        return mla.is_mla_config(config)

    @classmethod
    def fields(cls, verifier, parent_config: dict | None) -> dict:
        source = layer_dict(parent_config) if cls.describes(parent_config) else verifier.to_dict()
        return mla_layer_fields(source, intermediate_size=verifier.intermediate_size)

    @staticmethod
    def beside(verifier) -> bool:
        """Whether vLLM serves this kind beside ``verifier`` (a transformers config): it has MLA attention."""
        return getattr(verifier, "kv_lora_rank", None) is not None

    @classmethod
    def check(cls, verifier, parent_config: dict | None, where: str) -> None:
        if not cls.beside(verifier):
            raise ConfigError(f"--drafter-layer mla: the verifier {where} ({verifier.model_type}) has no MLA attention "
                              "(no kv_lora_rank), and vLLM serves an MLA drafter only beside an MLA verifier: pass "
                              "--drafter-layer llama (or auto)")
        if cls.describes(parent_config):
            ours, theirs = mla.mla_dims(verifier), mla.mla_dims(layer_dict(parent_config))
            wrong = [f"{k} {theirs[k]} (verifier {ours[k]})" for k in mla.DIMS if theirs[k] != ours[k]]
            if wrong:
                raise ParentMismatch(f"the MLA parent's {', '.join(wrong)} differ from the verifier {where}'s: vLLM "
                                     "serves the drafter's MLA with the verifier's MLA kernels and cache, so they "
                                     "must match; choose a parent made for this verifier, or init=random")

    @classmethod
    def drafter_config(cls, fields: dict[str, Any], *, draft_vocab_size: int, aux_layer_ids: list[int] | None,
                       norm_before_residual: bool = False, form: EagleForm = EagleForm()):
        # a flat config without a dense MLP width gets 3 x hidden, speculators' own rule for MoE verifiers
        layer = mla_layer_fields(fields, intermediate_size=3 * int(fields["hidden_size"]))
        layer_cfg = mla.layer_config_object({**layer, "vocab_size": fields.get("vocab_size")})
        return speculator_config(layer_cfg, draft_vocab_size=draft_vocab_size, aux_layer_ids=aux_layer_ids,
                                 norm_before_residual=norm_before_residual, form=form)

    @classmethod
    def served_config(cls, model) -> dict:
        """vLLM's ``Eagle3DeepseekV2ForCausalLM`` config.json (lightseekorg/kimi-k2.5-eagle3-mla's form), every
        field from the drafter's own MLA layer: ``model_type`` ``kimi_k2`` (vLLM rewrites ``deepseek_v3`` into an
        MTP model), the aux layers wherever either of vLLM's runners reads them, no quantization."""
        layer = model.config.transformer_layer_config
        rope = dict(getattr(layer, "rope_parameters", None) or {})
        out: dict[str, Any] = {
            "architectures": [mla.VLLM_ARCHITECTURE],
            "model_type": mla.SERVED_MODEL_TYPE,
            **{k: getattr(layer, k) for k in mla.MLA_FIELDS
               if k not in ("rope_parameters", "rope_scaling", "rope_theta") and getattr(layer, k, None) is not None},
            "num_hidden_layers": 1,
            "first_k_dense_replace": 1,
            "rope_theta": float(rope.get("rope_theta", 10000.0)),
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "vocab_size": layer.vocab_size,
            "draft_vocab_size": model.draft_vocab_size,
            "target_hidden_size": layer.hidden_size,
            "norm_before_residual": bool(model.config.norm_before_residual),
            **EagleForm.of_model(model.config).fields(),  # written whatever they are: readers differ on absence
            **served_aux_fields(list(model.config.eagle_aux_hidden_state_layer_ids)),
        }
        if rope.get("rope_type") not in (None, "default"):
            out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
        return out


def mla_layer_fields(source: dict, *, intermediate_size: int) -> dict:
    """An MLA layer's fields from ``source`` (a verifier's config, a parent's flat lightseek/vLLM config or layer
    config); ``intermediate_size`` where it names no dense MLP width. Always ``num_key_value_heads`` = heads (MLA
    expands the latent into every head) and a dense MLP (``first_k_dense_replace`` 1)."""
    fields = {k: source.get(k) for k in mla.MLA_FIELDS if source.get(k) is not None}
    if "rope_parameters" not in fields and "rope_scaling" in fields:  # flat: rope_theta + rope_scaling
        fields["rope_parameters"] = {**(fields["rope_scaling"] or {}), "rope_theta": fields.get("rope_theta", 10000.0)}
    fields.pop("rope_scaling", None)
    if "rope_parameters" in fields:
        fields.pop("rope_theta", None)
    fields["num_key_value_heads"] = fields["num_attention_heads"]
    fields.setdefault("intermediate_size", intermediate_size)
    layer = mla.layer_config_object(fields)  # normalised as transformers reads it (rope_parameters)
    out = {k: v for k, v in layer.to_dict().items() if k in mla.MLA_FIELDS and v is not None}
    return {"model_type": mla.MLA_MODEL_TYPE, **out, "first_k_dense_replace": 1}


def decoder_layer_fields(verifier) -> dict:
    """The fields of a Llama/Qwen3 verifier's config that describe its decoder layer: the keys its config class
    defines, less :data:`VERIFIER_ONLY_KEYS` (extra keys a hub config adds, quantization among them, dropped)."""
    known = set(type(verifier)().to_dict())
    out = {k: v for k, v in verifier.to_dict().items() if k in known and k not in VERIFIER_ONLY_KEYS}
    if isinstance(out.get("layer_types"), list):  # per layer; the drafter has one
        out["layer_types"] = out["layer_types"][:1]
    return out


def named(name: str) -> type[DrafterLayer]:
    """The kind ``name`` (``--drafter-layer``, a run's ``drafter.layer``)."""
    if name not in LAYERS:
        raise ConfigError(f"drafter layer {name!r}: choose one of {', '.join(LAYERS)}")
    return LAYERS[name]


def of_layer(layer: dict) -> type[DrafterLayer]:
    """The kind of a layer config dict (the layer a run trains, a model's ``transformer_layer_config``)."""
    return MlaLayer if MlaLayer.describes(layer) else LlamaLayer


def for_verifier(verifier) -> type[DrafterLayer]:
    """The kind a drafter without a parent gets: MLA where vLLM serves it beside ``verifier``, else Llama."""
    return MlaLayer if MlaLayer.beside(verifier) else LlamaLayer


def of_parent(config: dict | None) -> type[DrafterLayer] | None:
    """The kind a parent's config describes, or None when it says none."""
    return next((kind for kind in LAYERS.values() if kind.describes(config)), None)
