"""The one place that knows an EAGLE-3 drafter's shape: its decoder layer (a Llama-family layer or DeepSeek-V3's
MLA, :mod:`draftline.drafter.mla`) and which one a run trains, its aux layers, the two checkpoint layouts' key
prefixes, the Kimi reference shapes, and the configs speculators, SpecForge and vLLM describe it with.

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

from draftline.drafter import mla
from draftline.drafter.aux_ids import CONVENTION_KEY, aux_layer_ids, served_aux_fields
from draftline.drafter.form import EagleForm
from draftline.drafter.form import split as split_form
from draftline.errors import ConfigError, DataError, ParentMismatch
from draftline.serving import hf_model

SUPPORTED_LAYERS = ("llama", "qwen3")  # the verifier layers speculators' Eagle3DraftModel builds as they are
# ``--drafter-layer``: ``llama`` is the Llama family (a Llama/Qwen3 verifier's own layer, else a Llama layer from
# the verifier's sizes), ``mla`` DeepSeek-V3's MLA layer with a dense MLP; ``auto`` the parent's, and for
# init=random MLA for a verifier with MLA attention, Llama otherwise.
LAYER_CHOICES = ("auto", "llama", "mla")
LLAMA_LAYER_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                    "rms_norm_eps", "max_position_embeddings", "hidden_act", "attention_bias", "rope_theta",
                    "rope_scaling", "rope_parameters")

# The two layouts of a drafter's one decoder layer: SpecForge/EAGLE/AQ-MedAI write ``midlayer.*``, speculators
# (and vLLM's loader) ``layers.0.*``.
MIDLAYER_PREFIX, SPECULATORS_PREFIX = "midlayer.", "layers.0."
MIDLAYER_REMAP = f"{MIDLAYER_PREFIX}->{SPECULATORS_PREFIX}"

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


def key_remap(layout: str) -> str:
    """What loading a checkpoint of ``layout`` renames (recorded as ``parent.key_remap``)."""
    return MIDLAYER_REMAP if layout == "midlayer" else "none"


def require_aux_layers(drafter: str, reads: list[int] | None, data: list[int]) -> None:
    """The one check that data captured from the verifier's layers ``data`` feeds a drafter that reads
    ``reads`` (``None``: the drafter records none and takes the data's)."""
    if reads and list(reads) != list(data):
        raise DataError(f"the data has aux layers {list(data)} but {drafter} reads {list(reads)}: prepare the data "
                        f"with --aux-layers {','.join(map(str, reads))}")


def default_aux_layers(num_hidden_layers: int) -> list[int]:
    """EAGLE-3's default: an early, a middle and a late layer of the verifier."""
    return [2, num_hidden_layers // 2, num_hidden_layers - 3]


def layer_kind(layer: dict) -> str:
    """``mla`` or ``llama`` (the Llama family: Llama and Qwen3 layers) for a layer config dict."""
    return "mla" if mla.is_mla_config(layer) else "llama"


def parent_layer_kind(config: dict | None) -> str | None:
    """The layer a parent's config describes (``mla``/``llama``), or None when it says none."""
    if mla.is_mla_config(config):
        return "mla"
    return "llama" if _parent_layer_fields(config) else None


def layer_config(verifier_name_or_path: str, parent_config: dict | None = None, kind: str = "auto") -> dict:
    """The drafter's one decoder layer, as a config dict (``model_type`` included) that travels with the run.

    ``kind`` (``--drafter-layer``): ``auto`` takes the parent's layer, and for a random init MLA for a verifier
    with MLA attention, Llama otherwise. ``llama``: a Llama or Qwen3 verifier lends its own layer, as EAGLE-3
    prescribes; any other verifier gets a Llama layer, the parent's when the parent says what it is (AQ-MedAI's
    config.json is a ``LlamaForCausalLMEagle3`` layer), else one derived from the verifier's sizes (heads of
    ``v_head_dim``, the verifier's dense MLP width). ``mla``: DeepSeek-V3's MLA layer with a dense MLP, the
    parent's sizes where it has an MLA layer, else the verifier's (its MLA dims, heads and dense MLP width).
    Raises :class:`ConfigError`/:class:`ParentMismatch` (exit 2) for a combination no run could serve.
    """
    verifier = hf_model.load_text_config(verifier_name_or_path)
    kind = choose_layer(kind, verifier, parent_config, verifier_name_or_path)
    if kind == "mla":
        source = _layer_dict(parent_config) if mla.is_mla_config(parent_config) else verifier.to_dict()
        out = _mla_layer_fields(source, intermediate_size=verifier.intermediate_size)
    elif verifier.model_type in SUPPORTED_LAYERS:
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


def choose_layer(kind: str, verifier, parent_config: dict | None, where: str) -> str:
    """The one check of which decoder layer a run trains (see :func:`layer_config`); ``mla`` or ``llama``."""
    if kind not in LAYER_CHOICES:
        raise ConfigError(f"--drafter-layer {kind!r}: choose one of {', '.join(LAYER_CHOICES)}")
    verifier_mla = getattr(verifier, "kv_lora_rank", None) is not None
    parent = parent_layer_kind(parent_config)
    if parent_config and str(parent_config.get("model_type")) == mla.MLA_MODEL_TYPE and \
            parent_config.get("kv_lora_rank") is not None:
        raise ParentMismatch(f"the parent's config.json says model_type {mla.MLA_MODEL_TYPE!r}, which vLLM rewrites "
                             "into a DeepSeek MTP model and refuses as an EAGLE-3 drafter: set \"model_type\": "
                             f"\"{mla.SERVED_MODEL_TYPE}\" in its config.json (vLLM reads that as DeepSeek-V3)")
    if kind == "auto":
        kind = parent or ("mla" if verifier_mla else "llama")
    if kind == "mla" and not verifier_mla:
        raise ConfigError(f"--drafter-layer mla: the verifier {where} ({verifier.model_type}) has no MLA attention "
                          "(no kv_lora_rank), and vLLM serves an MLA drafter only beside an MLA verifier: pass "
                          "--drafter-layer llama (or auto)")
    if parent and parent != kind:
        raise ParentMismatch(f"--drafter-layer {kind}: the parent is a {parent.upper() if parent == 'mla' else 'Llama'}"
                             f"-layer drafter, whose weights do not fit a{'n MLA' if kind == 'mla' else ' Llama'} "
                             f"layer: pass --drafter-layer {parent} (or auto), or choose a parent with "
                             f"a{'n MLA' if kind == 'mla' else ' Llama'} layer, or init=random")
    if kind == "mla" and parent == "mla":
        ours, theirs = mla.mla_dims(verifier), mla.mla_dims(_layer_dict(parent_config))
        wrong = [f"{k} {theirs[k]} (verifier {ours[k]})" for k in mla.DIMS if theirs[k] != ours[k]]
        if wrong:
            raise ParentMismatch(f"the MLA parent's {', '.join(wrong)} differ from the verifier {where}'s: vLLM "
                                 "serves the drafter's MLA with the verifier's MLA kernels and cache, so they must "
                                 "match; choose a parent made for this verifier, or init=random")
    return kind


def _layer_dict(config: dict | None) -> dict:
    config = config or {}
    tl = config.get("transformer_layer_config")
    return tl if isinstance(tl, dict) else config


def _mla_layer_fields(source: dict, *, intermediate_size: int) -> dict:
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


def llama_drafter_config(fields: dict[str, Any], *, draft_vocab_size: int, aux_layer_ids: list[int] | None,
                         norm_before_residual: bool = False, form: EagleForm = EagleForm()):
    """One Llama layer from flat config fields (SpecForge's config.json, or :data:`KIMI_K2`)."""
    keys = (*LLAMA_LAYER_KEYS, "vocab_size")
    layer = LlamaConfig(**{k: v for k, v in fields.items() if k in keys and v is not None}, num_hidden_layers=1)
    return speculator_config(layer, draft_vocab_size=draft_vocab_size, aux_layer_ids=aux_layer_ids,
                             norm_before_residual=norm_before_residual, form=form)


def mla_drafter_config(fields: dict[str, Any], *, draft_vocab_size: int, aux_layer_ids: list[int] | None,
                       norm_before_residual: bool = False, form: EagleForm = EagleForm()):
    """One MLA layer from flat config fields (vLLM's ``Eagle3DeepseekV2ForCausalLM`` config.json, or
    :data:`KIMI_K25_MLA`)."""
    # a flat config without a dense MLP width gets 3 x hidden, speculators' own rule for MoE verifiers
    layer = _mla_layer_fields(fields, intermediate_size=3 * int(fields["hidden_size"]))
    layer_cfg = mla.layer_config_object({**layer, "vocab_size": fields.get("vocab_size")})
    return speculator_config(layer_cfg, draft_vocab_size=draft_vocab_size, aux_layer_ids=aux_layer_ids,
                             norm_before_residual=norm_before_residual, form=form)


def default_config(layer: str = "llama", draft_vocab_size: int | None = None):
    """The real Kimi drafter's shape: AQ-MedAI's Kimi-K2 Llama layer, or (``mla``) lightseek's Kimi-K2.5 MLA one;
    ``draft_vocab_size`` replaces its draft vocabulary (32,000 and the full 163,840 tokens)."""
    shape = KIMI_K25_MLA if layer == "mla" else KIMI_K2
    vocab = int(draft_vocab_size or shape["draft_vocab_size"])
    if not 2 <= vocab <= shape["vocab_size"]:
        raise ConfigError(f"draft vocabulary {vocab}: between 2 and the verifier's {shape['vocab_size']} tokens")
    build = mla_drafter_config if layer == "mla" else llama_drafter_config
    return build(shape, draft_vocab_size=vocab, aux_layer_ids=shape["aux_layer_ids"])


def verifier_config(verifier: str, *, draft_vocab_size: int, aux_layer_ids: list[int], layer: dict | None = None):
    """The drafter finetune trains: the decoder layer of :func:`layer_config` (the verifier's own for
    Llama/Qwen3 verifiers, else a Llama layer) around the verifier (config.json only)."""
    vc = hf_model.load_config(verifier)
    fields, form = split_form(layer or layer_config(verifier))
    fields = {k: v for k, v in fields.items() if k not in VERIFIER_ONLY_KEYS}
    layer_cfg = AutoConfig.for_model(fields.pop("model_type"), **fields)
    return speculator_config(layer_cfg, draft_vocab_size=draft_vocab_size, aux_layer_ids=aux_layer_ids,
                             verifier=verifier, architectures=vc.architectures, form=form)


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
    if mla.is_mla_config(raw) and raw.get("hidden_size"):  # vLLM's Eagle3DeepseekV2ForCausalLM (lightseek)
        return mla_drafter_config(raw, draft_vocab_size=int(raw.get("draft_vocab_size") or raw["vocab_size"]),
                                  aux_layer_ids=aux_layer_ids(raw),
                                  norm_before_residual=bool(raw.get("norm_before_residual", False)),
                                  form=EagleForm.of_config(raw))
    if raw.get("draft_vocab_size") and raw.get("hidden_size"):  # SpecForge / AQ-MedAI
        return llama_drafter_config(raw, draft_vocab_size=int(raw["draft_vocab_size"]),
                                    aux_layer_ids=aux_layer_ids(raw),
                                    norm_before_residual=bool(raw.get("norm_before_residual", False)),
                                    form=EagleForm.of_config(raw))
    raise ConfigError(f"{where} is neither a speculators EAGLE-3 config nor a SpecForge LlamaForCausalLMEagle3 "
                      "one (no speculators_model_type, no draft_vocab_size)")


def rope_theta(layer) -> float:
    """The rope base of a layer config (transformers 5 keeps it in ``rope_parameters``)."""
    params = getattr(layer, "rope_parameters", None) or {}
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta if theta is not None else getattr(layer, "rope_theta", 10000.0))


def served_mla_config(layer, *, draft_vocab_size: int, aux_layer_ids: list[int],
                      norm_before_residual: bool = False, form: EagleForm = EagleForm()) -> dict:
    """The ``config.json`` vLLM loads as ``Eagle3DeepseekV2ForCausalLM`` (lightseekorg/kimi-k2.5-eagle3-mla's form),
    every field from the drafter's own MLA layer config ``layer``: ``model_type`` ``kimi_k2`` (vLLM rewrites
    ``deepseek_v3`` into an MTP model), the aux layers wherever either of vLLM's runners reads them
    (:func:`~draftline.drafter.aux_ids.served_aux_fields`), no quantization."""
    rope = dict(getattr(layer, "rope_parameters", None) or {})
    out: dict[str, Any] = {
        "architectures": [mla.VLLM_ARCHITECTURE],
        "model_type": mla.SERVED_MODEL_TYPE,
        **{k: getattr(layer, k) for k in mla.MLA_FIELDS if k not in ("rope_parameters", "rope_scaling", "rope_theta")
           and getattr(layer, k, None) is not None},
        "num_hidden_layers": 1,
        "first_k_dense_replace": 1,
        "rope_theta": float(rope.get("rope_theta", 10000.0)),
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "vocab_size": layer.vocab_size,
        "draft_vocab_size": draft_vocab_size,
        "target_hidden_size": layer.hidden_size,
        "norm_before_residual": norm_before_residual,
        **form.fields(),  # written whatever they are: readers differ on what an absent key means
        **served_aux_fields(aux_layer_ids),
    }
    if rope.get("rope_type") not in (None, "default"):
        out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    return out


def specforge_config(layer, *, draft_vocab_size: int, aux_layer_ids: list[int], form: EagleForm = EagleForm(),
                     norm_before_residual: bool = False) -> dict:
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
        # explicit: SpecForge reads an absent norm_output as true, vLLM and SGLang as false
        **form.fields(), "norm_before_residual": norm_before_residual,
        CONVENTION_KEY: "vllm",  # whose layers the ids name: the input of layer i, as vLLM captures them
    }
    scaling = (getattr(layer, "rope_parameters", None) or {}) if isinstance(
        getattr(layer, "rope_parameters", None), dict) else {}
    if scaling.get("rope_type") not in (None, "default"):
        out["rope_scaling"] = {k: v for k, v in scaling.items() if k != "rope_theta"}
    return out
