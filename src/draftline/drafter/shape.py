"""An EAGLE-3 drafter's shape: which decoder layer a run trains (chosen here, built by its kind in
:mod:`draftline.drafter.layer_kinds`), its aux layers, the two checkpoint layouts' key prefixes, the real Kimi
drafters' configs (:func:`default_config`) and the configs speculators and SpecForge describe it with.

Model building (``drafter/model.py``), the memory plan, ``inspect``, finetune's parent checks and export's
SpecForge layout all read the shape from here; nothing here imports torch at module level.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from speculators import SpeculatorModelConfig
from transformers import AutoConfig

from draftline.drafter import layer_kinds, mla
from draftline.drafter.aux_ids import CONVENTION_KEY, aux_layer_ids
from draftline.drafter.form import EagleForm
from draftline.drafter.form import split as split_form
from draftline.drafter.layer_kinds import VERIFIER_ONLY_KEYS, speculator_config
from draftline.errors import ConfigError, DataError, ParentMismatch
from draftline.serving import hf_model

# ``--drafter-layer``: ``llama`` is the Llama family (a Llama/Qwen3 verifier's own layer, else a Llama layer from
# the verifier's sizes), ``mla`` DeepSeek-V3's MLA layer with a dense MLP; ``auto`` the parent's, and for
# init=random MLA for a verifier with MLA attention, Llama otherwise.
LAYER_CHOICES = ("auto", *layer_kinds.LAYERS)

# The two layouts of a drafter's one decoder layer: SpecForge/EAGLE/AQ-MedAI write ``midlayer.*``, speculators
# (and vLLM's loader) ``layers.0.*``.
MIDLAYER_PREFIX, SPECULATORS_PREFIX = "midlayer.", "layers.0."
MIDLAYER_REMAP = f"{MIDLAYER_PREFIX}->{SPECULATORS_PREFIX}"

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
    """The kind's name (``mla``, or ``llama``: the Llama family, Llama and Qwen3 layers) of a layer config dict."""
    return layer_kinds.of_layer(layer).served.name


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
    out = layer_kinds.named(kind).fields(verifier, parent_config)
    out.update(num_hidden_layers=1, vocab_size=verifier.vocab_size)
    return out


def choose_layer(kind: str, verifier, parent_config: dict | None, where: str) -> str:
    """The one check of which decoder layer a run trains (see :func:`layer_config`); ``mla`` or ``llama``."""
    if kind not in LAYER_CHOICES:
        raise ConfigError(f"--drafter-layer {kind!r}: choose one of {', '.join(LAYER_CHOICES)}")
    found = layer_kinds.of_parent(parent_config)
    parent = found.served.name if found else None
    if parent_config and str(parent_config.get("model_type")) == mla.MLA_MODEL_TYPE and \
            parent_config.get("kv_lora_rank") is not None:
        raise ParentMismatch(f"the parent's config.json says model_type {mla.MLA_MODEL_TYPE!r}, which vLLM rewrites "
                             "into a DeepSeek MTP model and refuses as an EAGLE-3 drafter: set \"model_type\": "
                             f"\"{mla.SERVED_MODEL_TYPE}\" in its config.json (vLLM reads that as DeepSeek-V3)")
    if kind == "auto":
        kind = parent or layer_kinds.for_verifier(verifier).served.name
    chosen = layer_kinds.named(kind)
    if found and found is not chosen:
        raise ParentMismatch(f"--drafter-layer {kind}: the parent is a drafter with {found.served.what}, whose "
                             f"weights do not fit {chosen.served.what}: pass --drafter-layer {parent} (or auto), "
                             f"or choose a parent with {chosen.served.what}, or init=random")
    chosen.check(verifier, parent_config, where)
    return kind


def default_config(layer: str = "llama", draft_vocab_size: int | None = None):
    """The real Kimi drafter's shape: AQ-MedAI's Kimi-K2 Llama layer, or (``mla``) lightseek's Kimi-K2.5 MLA one;
    ``draft_vocab_size`` replaces its draft vocabulary (32,000 and the full 163,840 tokens)."""
    kind = layer_kinds.named(layer)
    shape = kind.reference
    vocab = int(draft_vocab_size or shape["draft_vocab_size"])
    if not 2 <= vocab <= shape["vocab_size"]:
        raise ConfigError(f"draft vocabulary {vocab}: between 2 and the verifier's {shape['vocab_size']} tokens")
    return kind.drafter_config(shape, draft_vocab_size=vocab, aux_layer_ids=shape["aux_layer_ids"])


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
    mla_flat = mla.is_mla_config(raw) and raw.get("hidden_size")  # vLLM's Eagle3DeepseekV2ForCausalLM (lightseek)
    if mla_flat or (raw.get("draft_vocab_size") and raw.get("hidden_size")):  # or SpecForge's (AQ-MedAI)
        return layer_kinds.of_layer(raw).drafter_config(
            raw, draft_vocab_size=int(raw.get("draft_vocab_size") or raw["vocab_size"]),
            aux_layer_ids=aux_layer_ids(raw), norm_before_residual=bool(raw.get("norm_before_residual", False)),
            form=EagleForm.of_config(raw))
    raise ConfigError(f"{where} is neither a speculators EAGLE-3 config nor a SpecForge LlamaForCausalLMEagle3 "
                      "one (no speculators_model_type, no draft_vocab_size)")


def rope_theta(layer) -> float:
    """The rope base of a layer config (transformers 5 keeps it in ``rope_parameters``)."""
    params = getattr(layer, "rope_parameters", None) or {}
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    return float(theta if theta is not None else getattr(layer, "rope_theta", 10000.0))


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
