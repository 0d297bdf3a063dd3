"""The one place that knows an EAGLE-3 drafter's shape: its decoder layer, its aux layers, the two checkpoint
layouts' key prefixes, the Kimi-K2 reference shape, and the configs speculators and SpecForge describe it with.

Model building (``drafter/model.py``), the memory plan, ``inspect``, finetune's parent checks and export's
SpecForge layout all read the shape from here; nothing here imports torch at module level.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from speculators import SpeculatorModelConfig
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.models.eagle3 import Eagle3SpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig
from transformers import AutoConfig, LlamaConfig

from draftline.errors import ConfigError, DataError
from draftline.serving import hf_model

SUPPORTED_LAYERS = ("llama", "qwen3")  # the decoder layers speculators' Eagle3DraftModel can build
LLAMA_LAYER_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                    "rms_norm_eps", "max_position_embeddings", "hidden_act", "attention_bias", "rope_theta",
                    "rope_scaling", "rope_parameters")

# The two layouts of a drafter's one decoder layer: SpecForge/EAGLE/AQ-MedAI write ``midlayer.*``, speculators
# (and vLLM's loader) ``layers.0.*``.
MIDLAYER_PREFIX, SPECULATORS_PREFIX = "midlayer.", "layers.0."
MIDLAYER_REMAP = f"{MIDLAYER_PREFIX}->{SPECULATORS_PREFIX}"

# The AQ-MedAI/Kimi-K2-Instruct-eagle3 drafter as its config.json describes it (docs/design.md): one Llama layer.
KIMI_K2 = {
    "hidden_size": 7168, "intermediate_size": 18432, "num_attention_heads": 64, "num_key_value_heads": 64,
    "head_dim": 128, "vocab_size": 163840, "draft_vocab_size": 32000, "aux_layer_ids": [2, 30, 58],
    "rope_theta": 1e6, "rms_norm_eps": 1e-5, "max_position_embeddings": 8192,
}


def key_remap(layout: str) -> str:
    """What loading a checkpoint of ``layout`` renames (recorded as ``parent.key_remap``)."""
    return MIDLAYER_REMAP if layout == "midlayer" else "none"


def require_aux_layers(drafter: str, reads: list[int] | None, data: list[int]) -> None:
    """The one check that data captured from the verifier's layers ``data`` feeds a drafter that reads
    ``reads`` (``None``: the drafter records none and takes the data's)."""
    if reads and list(reads) != list(data):
        raise DataError(f"the data has aux layers {list(data)} but {drafter} reads {list(reads)}: prepare the data "
                        f"with --aux-layers {','.join(map(str, reads))}")


def aux_layer_ids(config: dict) -> list[int] | None:
    """The verifier layers a drafter reads, from a speculators config or a SpecForge one (``eagle_config``)."""
    for holder in (config, config.get("eagle_config") or {}):
        if holder.get("eagle_aux_hidden_state_layer_ids"):
            return list(holder["eagle_aux_hidden_state_layer_ids"])
    return None


def default_aux_layers(num_hidden_layers: int) -> list[int]:
    """EAGLE-3's default: an early, a middle and a late layer of the verifier."""
    return [2, num_hidden_layers // 2, num_hidden_layers - 3]


def layer_config(verifier_name_or_path: str, parent_config: dict | None = None) -> dict:
    """The drafter's one decoder layer, as a config dict (``model_type`` included) that travels with the run.

    A Llama or Qwen3 verifier lends its own layer config, as EAGLE-3 prescribes. Any other verifier (Kimi-K2 is
    ``deepseek_v3``, whose MLA/MoE layer speculators cannot build) gets a Llama layer: the parent's when the
    parent says what it is (AQ-MedAI's config.json is a ``LlamaForCausalLMEagle3`` layer), else one derived
    from the verifier's sizes (heads of ``v_head_dim``, the verifier's dense MLP width).
    """
    verifier = hf_model.load_text_config(verifier_name_or_path)
    if verifier.model_type in SUPPORTED_LAYERS:
        out = decoder_layer_fields(verifier)
    else:
        fields = _parent_layer_fields(parent_config) or {
            "hidden_size": verifier.hidden_size, "intermediate_size": verifier.intermediate_size,
            "num_attention_heads": verifier.num_attention_heads,
            "num_key_value_heads": verifier.num_attention_heads,
            "head_dim": getattr(verifier, "v_head_dim", None) or verifier.hidden_size // verifier.num_attention_heads,
            "rms_norm_eps": verifier.rms_norm_eps, "max_position_embeddings": verifier.max_position_embeddings,
            "hidden_act": "silu", "rope_parameters": getattr(verifier, "rope_parameters", None)}
        out = {"model_type": "llama", **{k: v for k, v in fields.items() if k in LLAMA_LAYER_KEYS and v is not None}}
    out.update(num_hidden_layers=1, vocab_size=verifier.vocab_size)
    return out


# What a verifier's config.json carries that is not its decoder layer's: identity, the head and, above all,
# quantization. vLLM loads a drafter layer whose config has a ``quantization_config`` as quantized (and refuses it:
# "Unknown quantization method"); production verifiers mostly ship one (FP8 block-quantized Kimi-K2/DeepSeek-V3,
# compressed-tensors INT4 Kimi-K2.5), so the drafter must never inherit it.
VERIFIER_ONLY_KEYS = ("_name_or_path", "architectures", "transformers_version", "auto_map", "id2label", "label2id",
                      "problem_type", "quantization_config", "compression_config", "tokenizer_class")


def decoder_layer_fields(verifier) -> dict:
    """The fields of a Llama/Qwen3 verifier's config that describe its decoder layer: the keys its config class
    defines, less :data:`VERIFIER_ONLY_KEYS` (extra keys a hub config adds, quantization among them, dropped)."""
    known = set(type(verifier)().to_dict())
    out = {k: v for k, v in verifier.to_dict().items() if k in known and k not in VERIFIER_ONLY_KEYS}
    if isinstance(out.get("layer_types"), list):  # per layer; the drafter has one
        out["layer_types"] = out["layer_types"][:1]
    return out


def _parent_layer_fields(config: dict | None) -> dict | None:
    if not config:
        return None
    if isinstance(config.get("transformer_layer_config"), dict):  # speculators layout
        return config["transformer_layer_config"]
    if config.get("model_type") == "llama" and config.get("hidden_size"):  # SpecForge / AQ-MedAI layout
        return config
    return None


def speculator_config(layer_config, *, draft_vocab_size: int, aux_layer_ids: list[int] | None,
                      verifier: str | None = None, architectures: list[str] | None = None,
                      norm_before_residual: bool = False):
    """An ``Eagle3SpeculatorConfig`` around a transformer layer config (as ``from_training_args`` builds it,
    without reading the verifier)."""
    return Eagle3SpeculatorConfig(
        transformer_layer_config=layer_config, draft_vocab_size=draft_vocab_size,
        norm_before_residual=norm_before_residual,
        eagle_aux_hidden_state_layer_ids=list(aux_layer_ids) if aux_layer_ids else None,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=verifier, architectures=list(architectures or []))))


def llama_drafter_config(fields: dict[str, Any], *, draft_vocab_size: int, aux_layer_ids: list[int] | None,
                         norm_before_residual: bool = False):
    """One Llama layer from flat config fields (SpecForge's config.json, or :data:`KIMI_K2`)."""
    keys = (*LLAMA_LAYER_KEYS, "vocab_size")
    layer = LlamaConfig(**{k: v for k, v in fields.items() if k in keys and v is not None}, num_hidden_layers=1)
    return speculator_config(layer, draft_vocab_size=draft_vocab_size, aux_layer_ids=aux_layer_ids,
                             norm_before_residual=norm_before_residual)


def default_config():
    """The real Kimi-K2 EAGLE-3 drafter's shape."""
    return llama_drafter_config(KIMI_K2, draft_vocab_size=KIMI_K2["draft_vocab_size"],
                                aux_layer_ids=KIMI_K2["aux_layer_ids"])


def verifier_config(verifier: str, *, draft_vocab_size: int, aux_layer_ids: list[int], layer: dict | None = None):
    """The drafter finetune trains: the decoder layer of :func:`layer_config` (the verifier's own for
    Llama/Qwen3 verifiers, else a Llama layer) around the verifier (config.json only)."""
    vc = hf_model.load_config(verifier)
    fields = {k: v for k, v in (layer or layer_config(verifier)).items() if k not in VERIFIER_ONLY_KEYS}
    layer_cfg = AutoConfig.for_model(fields.pop("model_type"), **fields)
    return speculator_config(layer_cfg, draft_vocab_size=draft_vocab_size, aux_layer_ids=aux_layer_ids,
                             verifier=verifier, architectures=vc.architectures)


def load_config(source: str | Path | dict[str, Any]):
    """A speculators config from a drafter directory, its ``config.json``, or that file's contents: the
    speculators layout (``speculators_model_type: eagle3``) or SpecForge's (``LlamaForCausalLMEagle3`` with
    ``draft_vocab_size``, as AQ-MedAI ships). Raises :class:`ConfigError`."""
    if isinstance(source, dict):
        raw, where = source, "the given config"
    else:
        path = Path(source).expanduser()
        path = path / "config.json" if path.is_dir() else path
        try:
            raw, where = json.loads(path.read_text()), str(path)
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"drafter config {path} is unreadable ({e}); pass a drafter directory or its "
                              "config.json") from None
    if raw.get("speculators_model_type") is not None:
        if raw["speculators_model_type"] != "eagle3":
            raise ConfigError(f"{where}: speculators_model_type={raw['speculators_model_type']!r}; the plan "
                              "covers EAGLE-3 drafters only")

        return SpeculatorModelConfig.from_dict(raw)
    if raw.get("draft_vocab_size") and raw.get("hidden_size"):  # SpecForge / AQ-MedAI
        return llama_drafter_config(raw, draft_vocab_size=int(raw["draft_vocab_size"]),
                                    aux_layer_ids=aux_layer_ids(raw),
                                    norm_before_residual=bool(raw.get("norm_before_residual", False)))
    raise ConfigError(f"{where} is neither a speculators EAGLE-3 config nor a SpecForge LlamaForCausalLMEagle3 "
                      "one (no speculators_model_type, no draft_vocab_size)")


def rope_theta(layer) -> float:
    """The rope base of a layer config (transformers 5 keeps it in ``rope_parameters``)."""
    params = getattr(layer, "rope_parameters", None) or {}
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta if theta is not None else getattr(layer, "rope_theta", 10000.0))


def specforge_config(layer, *, draft_vocab_size: int, aux_layer_ids: list[int]) -> dict:
    """The ``config.json`` SpecForge writes for an EAGLE-3 drafter (AQ-MedAI/Kimi-K2-Instruct-eagle3's form),
    every field taken from the drafter's own decoder-layer config ``layer`` (a transformers config): head_dim
    and the rope base are the layer's, never derived from another model's sizes."""
    head_dim = getattr(layer, "head_dim", None) or layer.hidden_size // layer.num_attention_heads
    out = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_act": getattr(layer, "hidden_act", "silu"),
        "hidden_size": layer.hidden_size,
        "intermediate_size": layer.intermediate_size,
        "num_attention_heads": layer.num_attention_heads,
        "num_key_value_heads": layer.num_key_value_heads,
        "head_dim": head_dim,
        "num_hidden_layers": 1,
        "max_position_embeddings": layer.max_position_embeddings,
        "rms_norm_eps": layer.rms_norm_eps,
        "rope_theta": rope_theta(layer),
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "vocab_size": layer.vocab_size,
        "draft_vocab_size": draft_vocab_size,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids), "use_aux_hidden_state": True},
    }
    scaling = (getattr(layer, "rope_parameters", None) or {}) if isinstance(
        getattr(layer, "rope_parameters", None), dict) else {}
    if scaling.get("rope_type") not in (None, "default"):
        out["rope_scaling"] = {k: v for k, v in scaling.items() if k != "rope_theta"}
    return out
