"""Where vLLM reads an EAGLE-3 drafter's aux-layer ids, the fields every export writes so that both of its model
runners read the same ones, and the one check that refuses a directory one of them would read otherwise.

vLLM 0.32 has two readers, which disagree on the nested keys (docs/design.md, "Aux-layer ids mean different layers
in different engines"):

* Model Runner V2 (the default wherever Triton is, i.e. GPUs):
  ``vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py`` ``get_eagle3_aux_layers_from_config`` reads top-level
  ``eagle_aux_hidden_state_layer_ids``, else ``eagle_config["layer_ids"]``; never
  ``eagle_config["eagle_aux_hidden_state_layer_ids"]``.
* The V1 runner (the CPU's: ``CPUModelRunner`` subclasses it): ``vllm/v1/worker/gpu_model_runner.py``
  ``GPUModelRunner._get_eagle3_aux_layers_from_config`` reads top-level ``eagle_aux_hidden_state_layer_ids``, else
  ``eagle_config["eagle_aux_hidden_state_layer_ids"]``; never ``eagle_config["layer_ids"]``.

Either falls back silently to the verifier's default layers ``(2, n // 2, n - 3)``. The drafter model sizes its
``fc`` input apart from both: ``llama_eagle3.py``/``deepseek_eagle3.py`` take ``num_aux_hidden_states``, else the
length of ``eagle_config["eagle_aux_hidden_state_layer_ids"]``, else 3 (``qwen3_eagle3.py`` also looks at
``num_aux_layers`` and the top-level ids). Both readers and the models read vLLM's ``hf_config``, which for
speculators' format is ``transformer_layer_config`` plus the fields ``SpeculatorsConfig`` copies to it
(``vllm/transformers_utils/configs/speculators``), and for a flat config the config itself (``EAGLEConfig`` copies
its fields).

Which layer an id names depends on the trainer that wrote it (docs/kimi.md, "Whose layer is id 2"): ``vllm`` (vLLM,
speculators, draftline: the *input* of layer i, transformers' ``hidden_states[i]``) or ``sglang`` (SpecForge, ModelOpt,
TorchSpec, and SGLang, which adds 1 to configured ids: the *output* of layer i). :func:`as_vllm_reads` turns a
parent's ids into the ones vLLM must capture for the layers the parent was trained on; draftline's own flat
configs say their convention (:data:`CONVENTION_KEY`).

Light on purpose (no torch, no transformers): ``pull`` and ``observe`` call :func:`require_served_ids`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from draftline.errors import CheckpointError, ParentMismatch

IDS = "eagle_aux_hidden_state_layer_ids"
RUNNERS = {"v1": "vLLM's V1 runner (the CPU's)", "v2": "vLLM's Model Runner V2 (the GPU default)"}
FIX = "re-export it with this draftline (draftline export --run <its finetune run>)"
CONVENTIONS = {"vllm": 0, "sglang": 1}  # what to add to an id for vLLM's reading of it
CONVENTION_KEY = "aux_layer_convention"  # in the flat configs draftline writes (vLLM and SGLang ignore it)
_SPECULATORS_ARCHITECTURES = {"qwen3": "Eagle3Qwen3ForCausalLM", "llama": "Eagle3LlamaForCausalLM"}


def served_aux_fields(aux_layer_ids: list[int]) -> dict[str, Any]:
    """The keys a flat drafter config (vLLM's ``Eagle3DeepseekV2ForCausalLM``, SpecForge's
    ``LlamaForCausalLMEagle3``) carries its aux layers in: top level (both runners), ``eagle_config.layer_ids``
    (V2), ``eagle_config.eagle_aux_hidden_state_layer_ids`` (V1, SpecForge, SGLang) and ``num_aux_hidden_states``
    (the drafter's ``fc`` width), all from the same ids."""
    ids = [int(i) for i in aux_layer_ids]
    return {IDS: ids, "num_aux_hidden_states": len(ids), CONVENTION_KEY: "vllm",
            "eagle_config": {IDS: ids, "layer_ids": ids, "use_aux_hidden_state": True}}


def parent_convention(asked: str, *, catalog: str | None, config: dict | None, registry: bool,
                      parent: str) -> tuple[str, str]:
    """``(convention, how it is known)`` of a parent's aux-layer ids: ``--parent-aux-convention``, else its
    catalog entry, else draftline's own registry or config key, else speculators' format (vLLM-literal). A parent
    none of these tell is refused: reading it wrong feeds ``fc`` every input one layer off."""
    config = config or {}
    if asked != "auto":
        return asked, "--parent-aux-convention"
    if catalog:
        return catalog, "the parent catalog"
    if registry:
        return "vllm", "draftline's registry"
    if config.get(CONVENTION_KEY) in CONVENTIONS:
        return str(config[CONVENTION_KEY]), f"its config's {CONVENTION_KEY}"
    if config.get("speculators_model_type"):
        return "vllm", "speculators' format"
    raise ParentMismatch(f"parent {parent}'s aux-layer ids {aux_layer_ids(config)} do not say whose layers they name: the input "
                         "of layer i (vLLM, speculators) or its output (SpecForge, ModelOpt, TorchSpec, SGLang); "
                         "pass --parent-aux-convention vllm or sglang, as its trainer wrote them")


def as_vllm_reads(ids: list[int], convention: str, num_layers: int, parent: str) -> list[int]:
    """The ids vLLM must capture for the layers ``ids`` name in ``convention`` (each one within the verifier's
    ``num_layers``: id ``num_layers`` is the last layer's output, before the final norm)."""
    shifted = [int(i) + CONVENTIONS[convention] for i in ids]
    if max(shifted, default=0) > num_layers:
        raise ParentMismatch(f"parent {parent}'s aux-layer ids {list(ids)} in the {convention} convention name the "
                             f"inputs of layers {shifted}, past the verifier's {num_layers}: pass "
                             "--parent-aux-convention vllm if its trainer meant the input of layer i")
    return shifted


def aux_layer_ids(config: dict) -> list[int] | None:
    """The verifier layers a drafter reads, from a speculators config or a SpecForge one (``eagle_config``)."""
    for holder in (config, config.get("eagle_config") or {}):
        if holder.get(IDS):
            return list(holder[IDS])
    return None


def vllm_view(config: dict) -> dict:
    """The fields vLLM's ``hf_config`` has for a drafter's ``config.json``: for speculators' format (vLLM tells it
    by ``speculators_config``) what ``SpeculatorsConfig.extract_transformers_pre_trained_config`` and
    ``algos.update_eagle3`` build (the layer config, the ids copied to the top level when set, the architecture
    by the layer's ``model_type``); a flat config as it is."""
    if config.get("speculators_config") is None:
        return config
    view = dict(config.get("transformer_layer_config") or {})
    if config.get(IDS):
        view[IDS] = config[IDS]
    view["architectures"] = [_SPECULATORS_ARCHITECTURES.get(str(view.get("model_type", "llama")), "")]
    return view


def aux_ids_by_runner(config: dict) -> dict[str, tuple[int, ...] | None]:
    """The aux-layer ids each of vLLM's runners reads from a drafter's ``config.json`` (``{"v1": ..., "v2":
    ...}``; None: it reads none and captures the verifier's default layers): vLLM 0.32's
    ``GPUModelRunner._get_eagle3_aux_layers_from_config`` (V1) and ``get_eagle3_aux_layers_from_config`` (V2),
    branch for branch, on :func:`vllm_view`."""
    view = vllm_view(config)
    return {"v1": _v1_reads(view), "v2": _v2_reads(view)}


def _v1_reads(view: dict) -> tuple[int, ...] | None:
    layer_ids = view.get(IDS)
    if not layer_ids:
        dflash, eagle = view.get("dflash_config"), view.get("eagle_config")
        if dflash and isinstance(dflash, dict):
            layer_ids = [i + 1 for i in (dflash.get("target_layer_ids") or [])]
        if eagle and isinstance(eagle, dict):
            layer_ids = eagle.get(IDS)
    return _ids(layer_ids)


def _v2_reads(view: dict) -> tuple[int, ...] | None:
    layer_ids = view.get(IDS)
    dflash = view.get("dflash_config")
    if not layer_ids and dflash and isinstance(dflash, dict):
        layer_ids = [i + 1 for i in (dflash.get("target_layer_ids") or [])]
    if not layer_ids and view.get("dspark_target_layer_ids"):
        shift = 0 if view.get("model_type") == "deepseek_v41" else 1
        layer_ids = [i + shift for i in view["dspark_target_layer_ids"]]
    if not layer_ids and view.get("target_layer_ids"):
        layer_ids = [i + 1 for i in view["target_layer_ids"]]
    for name in ("dflash_config", "eagle_config"):
        nested = view.get(name)
        if not layer_ids and nested and isinstance(nested, dict):
            layer_ids = nested.get("layer_ids")
    return _ids(layer_ids)


def fc_aux_count(config: dict) -> int:
    """How many aux hidden states vLLM's EAGLE-3 drafter model sizes its ``fc`` input for: ``num_aux_hidden_states``,
    else the nested ids' count, else 3 (``llama_eagle3.py``, ``deepseek_eagle3.py``); ``Eagle3Qwen3ForCausalLM``
    first reads ``num_aux_layers`` and also the top-level ids (``qwen3_eagle3.py``)."""
    view = vllm_view(config)
    nested = view.get("eagle_config")
    nested = nested if isinstance(nested, dict) else {}
    qwen3 = "Eagle3Qwen3ForCausalLM" in (view.get("architectures") or [])
    count = view.get("num_aux_layers") if qwen3 else None
    if count is None:
        count = view.get("num_aux_hidden_states")
    if count is None:
        ids = (view.get(IDS) if qwen3 else None) or nested.get(IDS)
        count = len(ids) if ids else 3
    return int(count)


def served_ids_problem(config: dict) -> str | None:
    """What keeps vLLM from reading the config's aux layers alike on both runners and sizing ``fc`` for them, in
    words, or None."""
    read = aux_ids_by_runner(config)
    if read["v1"] is None and read["v2"] is None:
        return "it names no aux-layer ids vLLM reads: both of its runners would capture the verifier's default layers"
    if read["v1"] != read["v2"]:
        said = "; ".join(f"{RUNNERS[r]} reads {list(ids) if ids else 'none (the verifier default layers)'}"
                         for r, ids in read.items())
        return f"vLLM's runners read different aux layers from it: {said}"
    ids = read["v1"] or ()
    if fc_aux_count(config) != len(ids):
        return (f"vLLM reads aux layers {list(ids)} but sizes the drafter's fc for {fc_aux_count(config)} aux hidden "
                "states (num_aux_hidden_states)")
    return None


def require_served_ids(directory: str | Path) -> dict:
    """Refuse (:class:`CheckpointError`) a drafter directory whose ``config.json`` vLLM's two runners would read
    different aux layers from, or none, or whose ``fc`` width disagrees with them; one line naming the file and
    the fix. Returns the config it read."""
    path = Path(directory) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is unreadable ({type(e).__name__}): pass the directory `draftline pull` "
                              "wrote") from None
    problem = served_ids_problem(config) if isinstance(config, dict) else "it is not a JSON object"
    if problem:
        raise CheckpointError(f"{path}: {problem}; {FIX}")
    return config


def _ids(value: Any) -> tuple[int, ...] | None:
    return tuple(value) if value and isinstance(value, list | tuple) else None
