"""A drafter written as the directory vLLM loads as it is, in the form vLLM knows for its layer.

* A Llama-family layer (Llama, Qwen3): speculators' format (``speculators_config``, ``layers.0.*``), which vLLM
  reads as ``Eagle3LlamaForCausalLM``/``Eagle3Qwen3ForCausalLM`` and, with the verifier named inside it, serves
  by the short form ``vllm serve <dir>``.
* An MLA layer: vLLM's ``Eagle3DeepseekV2ForCausalLM`` directory, as lightseekorg/kimi-k2.5-eagle3-mla ships it (a
  flat ``config.json`` saying ``model_type: kimi_k2``, the aux layers at its top level and under ``eagle_config``
  (:mod:`draftline.drafter.aux_ids`: where each of vLLM's runners reads them); ``midlayer.*``
  weights, ``d2t``/``t2d``, no embeddings: vLLM shares the verifier's). vLLM's speculators reader maps only
  ``llama``/``qwen3`` layers to an architecture, so this form is served by
  ``vllm serve <verifier> --speculative-config '{"model": <dir>, "method": "eagle3", ...}'``.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file

from draftline.drafter import layer_kinds
from draftline.drafter.aux_ids import IDS
from draftline.drafter.checkpoints import to_midlayer_layout

__all__ = ["is_mla_drafter", "save_served", "short_form"]


def is_mla_drafter(model) -> bool:
    """Whether ``model`` (an ``Eagle3DraftModel``) has an MLA decoder layer."""
    return layer_kinds.of_layer(model.config.transformer_layer_config.to_dict()) is layer_kinds.MlaLayer


def short_form(config: dict) -> bool:
    """Whether an exported ``config.json`` is served by ``vllm serve <dir>`` alone (speculators' format)."""
    return bool(config.get("speculators_model_type"))


def save_served(model, out: Path, verifier: str) -> Path:
    """Write ``model`` to ``out`` in the form vLLM serves for its layer; ``verifier`` the id or directory the
    speculators form names (the MLA form names none: the serve line does)."""
    out.mkdir(parents=True, exist_ok=True)
    flat = layer_kinds.of_layer(model.config.transformer_layer_config.to_dict()).served_config(model)
    if flat is None:  # speculators' format
        model.config.target_hidden_size = model.hidden_size
        model.config.speculators_config.verifier.name_or_path = str(verifier)
        model.save_pretrained(str(out), safe_serialization=True)
        _count_aux_for_vllm(out / "config.json")
        return out
    state = to_midlayer_layout({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()})
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(flat, indent=2) + "\n")
    return out


def _count_aux_for_vllm(path: Path) -> None:
    """vLLM builds a speculators-format drafter's config from ``transformer_layer_config`` and copies the ids to its
    top level, where both runners read them, but ``Eagle3LlamaForCausalLM`` sizes ``fc`` by
    ``num_aux_hidden_states`` (else 3): written into the layer config, which vLLM takes as it is."""
    cfg = json.loads(path.read_text())
    if not cfg.get(IDS):  # none to count: the export refuses it (write_drafter)
        return
    cfg["transformer_layer_config"]["num_aux_hidden_states"] = len(cfg[IDS])
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
