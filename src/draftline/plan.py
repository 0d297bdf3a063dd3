"""``draftline plan``: GPU memory per ZeRO stage for finetuning an EAGLE-3 drafter, before anything is launched.

Parameters are counted exactly, on the meta device (nothing is allocated): speculators' ``Eagle3DraftModel``
is built from the drafter's config and split into trainable parameters (``fc``, ``layers.*``, ``norm``) and
frozen ones (``embed_tokens``, ``lm_head``, ``verifier_lm_head``, ``verifier_norm``), as the model marks them.

Per GPU, for P trainable parameters, F frozen, L the largest trainable layer, Lf the largest frozen one,
N = nodes x gpus, bf16 (``precision=fp32``: see ``_fp32_model_states``):

* ZeRO-2 and ZeRO-3 model states come from DeepSpeed's own estimators
  (``estimate_zero2_model_states_mem_needs``: 2P + 18P/N; ``estimate_zero3_model_states_mem_needs``:
  4L + 18P/N; no offload), given the trainable parameters only; what their ``*_all_cold`` wrappers print is kept
  in the plan as DeepSpeed prints them.
* ZeRO-1 has no DeepSpeed estimator: we use the stage-2 formula with the 16-bit gradients not partitioned,
  4P + 16P/N (16-bit params and grads replicated; fp32 master, fp32 grads, Adam m and v partitioned).
* ZeRO-0 (no partitioning): 20P, an upper bound.
* Frozen parameters are not in the optimiser: 2 bytes each per GPU (bf16), replicated under ZeRO-0/1/2; under
  ZeRO-3 DeepSpeed partitions every module parameter, so 2F/N, plus 2Lf while the largest is gathered.
* Activations are an estimate (see :func:`activation_bytes`, checked on the CPU against what autograd saves).

A stage fits when model states + frozen + activations <= (1 - margin) x GPU memory. The margin (10% by
default) stands for what is not modelled: the CUDA context, NCCL and DeepSpeed buckets, allocator
fragmentation.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from draftline.errors import ConfigError, DraftlineError

GIB = 1 << 30
# One B200 (Blackwell) GPU: NVIDIA lists 180 GB per GPU for HGX/DGX B200 (1,440 GB for 8); pass
# --gpu-memory-gib with what nvidia-smi reports on the real machine (slightly less) to be exact.
DEFAULT_GPU_MEMORY_GIB = 180.0
DEFAULT_MARGIN = 0.10
STAGES = (0, 1, 2, 3)
# The AQ-MedAI/Kimi-K2-Instruct-eagle3 drafter as its config.json describes it (DESIGN.md): one Llama layer.
KIMI_K2 = {
    "hidden_size": 7168, "intermediate_size": 18432, "num_attention_heads": 64, "num_key_value_heads": 64,
    "head_dim": 128, "vocab_size": 163840, "draft_vocab_size": 32000, "aux_layer_ids": [2, 30, 58],
    "rope_theta": 1e6, "rms_norm_eps": 1e-5,
}


def _speculator_config(layer_config, *, draft_vocab_size: int, aux_layer_ids: list[int] | None,
                       verifier: str | None = None, architectures: list[str] | None = None,
                       norm_before_residual: bool = False):
    """An ``Eagle3SpeculatorConfig`` around a transformer layer config (as ``from_training_args`` builds it,
    without reading the verifier)."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

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
    from transformers import LlamaConfig

    from draftline.train.model import LLAMA_LAYER_KEYS

    keys = (*LLAMA_LAYER_KEYS, "vocab_size")
    layer = LlamaConfig(**{k: v for k, v in fields.items() if k in keys and v is not None}, num_hidden_layers=1)
    return _speculator_config(layer, draft_vocab_size=draft_vocab_size, aux_layer_ids=aux_layer_ids,
                              norm_before_residual=norm_before_residual)


def default_config():
    """The real Kimi-K2 EAGLE-3 drafter's shape."""
    return llama_drafter_config(KIMI_K2, draft_vocab_size=KIMI_K2["draft_vocab_size"],
                          aux_layer_ids=KIMI_K2["aux_layer_ids"])


def verifier_config(verifier: str, *, draft_vocab_size: int, aux_layer_ids: list[int], layer: dict | None = None):
    """The drafter finetune trains: the decoder layer of :func:`draftline.train.model.layer_config` (the
    verifier's own for Llama/Qwen3 verifiers, else a Llama layer) around the verifier (config.json only)."""
    from transformers import AutoConfig

    from draftline.train.model import layer_config

    vc = AutoConfig.from_pretrained(verifier)
    fields = dict(layer or layer_config(verifier))
    layer_cfg = AutoConfig.for_model(fields.pop("model_type"), **fields)
    return _speculator_config(layer_cfg, draft_vocab_size=draft_vocab_size, aux_layer_ids=aux_layer_ids,
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
        from speculators import SpeculatorModelConfig

        return SpeculatorModelConfig.from_dict(raw)
    if raw.get("draft_vocab_size") and raw.get("hidden_size"):  # SpecForge / AQ-MedAI
        aux = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get(
            "eagle_aux_hidden_state_layer_ids")
        return llama_drafter_config(raw, draft_vocab_size=int(raw["draft_vocab_size"]), aux_layer_ids=aux,
                              norm_before_residual=bool(raw.get("norm_before_residual", False)))
    raise ConfigError(f"{where} is neither a speculators EAGLE-3 config nor a SpecForge LlamaForCausalLMEagle3 "
                      "one (no speculators_model_type, no draft_vocab_size)")


def count_params(config) -> dict[str, Any]:
    """Exact parameter counts of the drafter ``config`` describes, built on the meta device."""
    import torch
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.models.eagle3.model_definitions import model_classes

    config = copy.deepcopy(config)
    tl = config.transformer_layer_config
    if tl.model_type not in model_classes:
        raise ConfigError(f"speculators builds EAGLE-3 layers for {', '.join(sorted(model_classes))} only; this "
                          f"drafter's layer config is {tl.model_type!r}")
    tl._attn_implementation = "sdpa"  # noqa: SLF001 (any: nothing runs; flex would want a GPU)
    with torch.device("meta"):
        model = Eagle3DraftModel(config)
    trainable = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p.numel() for n, p in model.named_parameters() if not p.requires_grad}

    def largest(want: bool) -> tuple[str, int]:  # DeepSpeed's "layer": a module's own parameters
        sizes = {name or "(model)": sum(p.numel() for p in m.parameters(recurse=False) if p.requires_grad == want)
                 for name, m in model.named_modules()}
        return max(sizes.items(), key=lambda kv: kv[1])

    (l_name, l_params), (f_name, f_params) = largest(True), largest(False)
    mlp = tl.intermediate_size
    return {
        "total": sum(trainable.values()) + sum(frozen.values()),
        "trainable": sum(trainable.values()),
        "frozen": sum(frozen.values()),
        "frozen_names": sorted(n.removesuffix(".weight") for n in frozen),
        "largest_layer": {"name": l_name, "params": l_params},
        "largest_frozen_layer": {"name": f_name, "params": f_params},
        "buffer_bytes": sum(b.numel() * b.element_size() for _, b in model.named_buffers()),
        "shape": {"hidden_size": model.hidden_size, "intermediate_size": mlp,
                  "num_attention_heads": tl.num_attention_heads,
                  "num_key_value_heads": tl.num_key_value_heads,
                  "head_dim": getattr(tl, "head_dim", None) or model.hidden_size // tl.num_attention_heads,
                  "draft_vocab_size": model.draft_vocab_size, "verifier_vocab_size": tl.vocab_size,
                  "num_aux": model.fc.in_features // model.hidden_size, "layers": tl.num_hidden_layers},
    }


def activation_bytes(shape: dict[str, int], tokens: int, ttt_steps: int, precision: str = "bf16",
                     attn_impl: str = "sdpa") -> dict:
    """An estimate of the activation memory of one forward+backward over ``tokens`` packed tokens: what autograd
    keeps for the backward in speculators' forward with draftline's eager KL loss, plus the inputs and target
    logits alive meanwhile. b is 2 (bf16) or 4 (fp32), H hidden, I intermediate, V draft vocabulary, q and kv
    the query and key/value widths (heads x head_dim), d head_dim, k ``ttt_steps``, T ``tokens``. Per token:

    * per TTT step: 4 RMSNorms x (4H fp32 copy + bH output), the q/k/v input b*2H, q, the attention output
      and its o_proj copy b*3q, the MLP's gate/up/activation/product b*4I, rotary cos/sin b*2d, the loss's
      fp32 log-softmax and target probabilities 8V (the three layer terms per layer);
    * keys and values, concatenated over the steps (step j attends to (j+1)T keys): b*2kv * k(k+1)/2, where
      kv is q for ``sdpa``/``eager`` (with a mask, transformers repeats grouped K/V heads before attention);
    * once: the fc input b*num_aux*H, the verifier's last hidden state b*H, the target logits b*V, and, when
      K/V heads are repeated, the cache itself b*2kv*k;
    * transient: the KL's elementwise fp32 output and the next logits, 4V + bV.

    Plus, over the whole batch, T^2 * k(k+1)/2 x (2 for ``sdpa``'s dense bf16 masks, or (4 + b) x heads for
    ``eager``'s materialised attention probabilities); ``simple_flex_attention`` has neither. Checked on the CPU
    against the tensors autograd saves (``torch.autograd.graph.saved_tensors_hooks``) for a scaled-down drafter:
    within 0.1% for sdpa and eager (tests/unit/test_plan.py). Not counted: gradients of activations during the
    backward (transient, one layer's worth at a time) and kernel workspaces; the margin covers them."""
    b = 2 if precision == "bf16" else 4
    h, i, v, d = shape["hidden_size"], shape["intermediate_size"], shape["draft_vocab_size"], shape["head_dim"]
    q, kv = shape["num_attention_heads"] * d, shape["num_key_value_heads"] * d
    layers, tri = shape.get("layers", 1), ttt_steps * (ttt_steps + 1) // 2
    norm = 4 * h + b * h
    per_step = layers * (3 * norm + b * (2 * h + 3 * q + 4 * i)) + norm + b * 2 * d + 8 * v
    repeated = attn_impl != "simple_flex_attention" and kv < q
    kv_cache = layers * b * 2 * (q if repeated else kv) * tri
    once = b * (shape["num_aux"] * h + h + v) + (layers * b * 2 * kv * ttt_steps if repeated else 0)
    transient = 4 * v + b * v
    per_token = ttt_steps * per_step + kv_cache + once + transient
    dense = {"simple_flex_attention": 0, "sdpa": 2, "eager": (4 + b) * shape["num_attention_heads"]}
    quadratic = layers * dense.get(attn_impl, 2) * tokens * tokens * tri
    return {"bytes": tokens * per_token + quadratic, "bytes_per_token": per_token, "quadratic": quadratic,
            "attn_impl": attn_impl,
            "formula": "tokens x (ttt_steps x per_step + kv_cache + once + transient) + masks/scores",
            "per_step": per_step, "kv_cache": kv_cache, "once": once, "transient": transient}


def _fp32_model_states(stage: int, p: int, largest: int, n: int) -> tuple[int, str]:
    """fp32 training (no 16-bit copies, no master weights): params 4, grads 4, Adam 8 bytes per parameter."""
    formula = {0: (16 * p, "16P"), 1: (8 * p + 8 * p // n, "8P + 8P/N"), 2: (4 * p + 12 * p // n, "4P + 12P/N"),
               3: (8 * largest + 16 * p // n, "8L + 16P/N")}[stage]
    return formula[0], f"fp32 (DeepSpeed's estimators assume 16-bit): {formula[1]}"


def model_state_bytes(counts: dict, stage: int, gpus: int, nodes: int, precision: str = "bf16") -> dict:
    """Per-GPU bytes of one stage's model states (trainable) and frozen parameters, and where the number is
    from."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    p, n = counts["trainable"], gpus * nodes
    largest, f = counts["largest_layer"]["params"], counts["frozen"]
    if precision == "fp32":
        states, source = _fp32_model_states(stage, p, largest, n)
    elif stage == 2:
        states = estimate_zero2_model_states_mem_needs(total_params=p, num_gpus_per_node=gpus, num_nodes=nodes,
                                                       cpu_offload=False)[1]
        source = "DeepSpeed estimate_zero2_model_states_mem_needs (no offload): 2P + 18P/N"
    elif stage == 3:
        states = estimate_zero3_model_states_mem_needs(total_params=p, largest_layer_params=largest,
                                                       num_gpus_per_node=gpus, num_nodes=nodes, cpu_offload=False,
                                                       cpu_offload_params=False, zero_init=False)[1]
        source = "DeepSpeed estimate_zero3_model_states_mem_needs (no offload): 4L + 18P/N"
    elif stage == 1:
        states, source = 4 * p + 16 * p // n, "DeepSpeed's stage-2 formula, 16-bit grads unpartitioned: 4P + 16P/N"
    else:
        states, source = 20 * p, "no partitioning: 20P (upper bound)"
    fb = 2 if precision == "bf16" else 4
    frozen = fb * f // n + fb * counts["largest_frozen_layer"]["params"] if stage == 3 else fb * f
    return {"model_states": int(states), "frozen": int(frozen) + counts["buffer_bytes"], "source": source}


def _deepspeed_reports(counts: dict, gpus: int, nodes: int) -> str:
    """What DeepSpeed's cold estimators print for the trainable parameters (every offload option)."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_cold
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs_all_cold

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print("ZeRO-2:")
        estimate_zero2_model_states_mem_needs_all_cold(counts["trainable"], num_gpus_per_node=gpus, num_nodes=nodes)
        print("ZeRO-3:")
        estimate_zero3_model_states_mem_needs_all_cold(counts["trainable"], counts["largest_layer"]["params"],
                                                       num_gpus_per_node=gpus, num_nodes=nodes)
    return out.getvalue()


def _max_tokens(room: int, acts: dict, tokens: int) -> int:
    """The most tokens per batch whose activations fit in ``room`` bytes (a*T + c*T^2 <= room)."""
    a, c = acts["bytes_per_token"], acts["quadratic"] / tokens**2
    if room <= 0:
        return 0
    return int(room // a) if not c else int((-a + math.sqrt(a * a + 4 * c * room)) / (2 * c))


def make_plan(config=None, *, gpus: int = 8, nodes: int = 1, gpu_memory_gib: float | None = DEFAULT_GPU_MEMORY_GIB,
              tokens_per_batch: int = 4096, ttt_steps: int = 3, precision: str = "bf16", attn_impl: str = "sdpa",
              margin: float = DEFAULT_MARGIN, zero_stage: int | None = None, name: str | None = None) -> dict:
    """The memory plan (JSON-serialisable) for a drafter: ``config`` is ``None`` (the real Kimi-K2 drafter), a
    drafter directory or config.json, its contents, or a speculators config. ``gpu_memory_gib=None``: the fit
    is not checked (``fits`` is None). ``zero_stage`` marks the stage that will be used. A stage that does not
    fit says the most ``tokens_per_batch`` and the fewest GPUs (up to 4096) with which it would."""
    if gpus < 1 or nodes < 1 or tokens_per_batch < 1 or ttt_steps < 1 or not 0 <= margin < 1:
        raise ConfigError(f"plan needs gpus>=1, nodes>=1, tokens_per_batch>=1, ttt_steps>=1, 0<=margin<1 (got "
                          f"gpus={gpus}, nodes={nodes}, tokens_per_batch={tokens_per_batch}, "
                          f"ttt_steps={ttt_steps}, margin={margin})")
    if precision not in ("bf16", "fp32"):
        raise ConfigError(f"precision must be bf16 or fp32, got {precision!r}")
    if zero_stage is not None and zero_stage not in STAGES:
        raise ConfigError(f"zero_stage must be one of 0-3, got {zero_stage}")
    if config is None:
        config, name = default_config(), name or "Kimi-K2 EAGLE-3 (AQ-MedAI shape)"
    elif isinstance(config, (str, Path, dict)):
        name = name or (str(config) if not isinstance(config, dict) else "drafter config")
        config = load_config(config)
    name = name or "drafter config"
    counts = count_params(config)
    acts = activation_bytes(counts["shape"], tokens_per_batch, ttt_steps, precision, attn_impl)
    budget = None if gpu_memory_gib is None else int(gpu_memory_gib * GIB * (1 - margin))
    stages = {}
    for stage in STAGES:
        ms = model_state_bytes(counts, stage, gpus, nodes, precision)
        total = ms["model_states"] + ms["frozen"] + acts["bytes"]
        st = stages[str(stage)] = {**ms, "activations": acts["bytes"], "total": total,
                                   "fits": None if budget is None else total <= budget,
                                   "headroom": None if budget is None else budget - total}
        if st["fits"] is False:
            st["max_tokens_per_batch"] = _max_tokens(budget - ms["model_states"] - ms["frozen"], acts,
                                                     tokens_per_batch)
            st["min_gpus"] = next((n for n in range(gpus * nodes + 1, 4097) if stage > 0 and sum(
                model_state_bytes(counts, stage, n, 1, precision)[k] for k in ("model_states", "frozen"))
                + acts["bytes"] <= budget), None)
    return {
        "drafter": name, "params": counts["total"], "trainable": counts["trainable"], "frozen": counts["frozen"],
        "frozen_names": counts["frozen_names"], "largest_layer": counts["largest_layer"],
        "largest_frozen_layer": counts["largest_frozen_layer"], "shape": counts["shape"],
        "gpus_per_node": gpus, "nodes": nodes, "gpu_memory_gib": gpu_memory_gib, "margin": margin,
        "budget_bytes": budget, "tokens_per_batch": tokens_per_batch, "ttt_steps": ttt_steps,
        "precision": precision, "zero_stage": zero_stage, "activations": acts, "stages": stages,
        "fits": None if zero_stage is None else stages[str(zero_stage)]["fits"],
        "deepspeed_estimators": _deepspeed_reports(counts, gpus, nodes),
    }


def _gib(n: int | None, unit: int = GIB) -> str:
    return "-" if n is None else f"{n / unit:.2f}"


def render(plan: dict) -> str:
    """The plan as a plain-text table."""
    lg, lf, a = plan["largest_layer"], plan["largest_frozen_layer"], plan["activations"]
    big = max(s["total"] for s in plan["stages"].values()) >= GIB
    unit, unit_name = (GIB, "GiB") if big else (1 << 20, "MiB")  # tiny drafters in MiB
    mem = "GPU memory unknown: fit not checked" if plan["gpu_memory_gib"] is None else (
        f"{plan['gpu_memory_gib']:g} GiB per GPU less {plan['margin']:.0%} margin = {_gib(plan['budget_bytes'])} GiB")
    lines = [
        f"drafter: {plan['drafter']}",
        f"  params {plan['params']:,} = trainable {plan['trainable']:,} + frozen {plan['frozen']:,} "
        f"({', '.join(plan['frozen_names'])})",
        f"  largest trainable layer {lg['name']} ({lg['params']:,}); largest frozen {lf['name']} ({lf['params']:,})",
        f"setup: {plan['nodes']} node(s) x {plan['gpus_per_node']} GPU(s); {mem}",
        f"  {plan['precision']}, tokens_per_batch {plan['tokens_per_batch']}, ttt_steps {plan['ttt_steps']}, "
        f"attention {a['attn_impl']}",
        "",
        f"  {unit_name + ' per GPU':<12}{'model states':>13}{'frozen':>9}{'activations':>13}{'total':>9}"
        f"{'headroom':>10}  fits",
    ]
    for stage, s in plan["stages"].items():
        fits = "?" if s["fits"] is None else ("yes" if s["fits"] else "NO")
        mark = "  <- chosen" if plan["zero_stage"] is not None and int(stage) == plan["zero_stage"] else ""
        cells = [_gib(s[k], unit) for k in ("model_states", "frozen", "activations", "total", "headroom")]
        lines.append(f"  ZeRO-{stage:<7}{cells[0]:>13}{cells[1]:>9}{cells[2]:>13}{cells[3]:>9}{cells[4]:>10}  "
                     f"{fits}{mark}")
    lines += ["", "model states (P trainable params, L largest trainable layer, N GPUs in all):"]
    lines += [f"  ZeRO-{k}: {s['source']}" for k, s in plan["stages"].items()]
    lines += [f"  frozen params: {2 if plan['precision'] == 'bf16' else 4} bytes each on every GPU; ZeRO-3 partitions "
              "them and gathers the largest",
              f"activations (an estimate): {a['formula']}",
              f"  = {plan['tokens_per_batch']} x ({plan['ttt_steps']} x {a['per_step']:,} + {a['kv_cache']:,} + "
              f"{a['once']:,} + {a['transient']:,}) + {a['quadratic']:,} bytes",
              "", "DeepSpeed's own estimators for the trainable params (per CPU, per GPU, every offload option):",
              *("  " + ln for ln in plan["deepspeed_estimators"].rstrip().splitlines())]
    return "\n".join(lines)


def fit_error(plan: dict, stage: int) -> str | None:
    """``None`` when ``stage`` fits (or the fit is not checked), else one sentence naming the stage, the
    numbers and the fixes that would work."""
    s = plan["stages"][str(stage)]
    if s["fits"] is not False:
        return None
    fixes = [f"--zero-stage {k}" for k in range(stage + 1, 4) if plan["stages"][str(k)]["fits"]][:1]
    if s.get("min_gpus"):
        fixes.append(f"more GPUs ({s['min_gpus']} in all; --gpus/--nodes)")
    if s.get("max_tokens_per_batch", 0) >= 16:
        fixes.append(f"--tokens-per-batch {s['max_tokens_per_batch']} or less")
    fixes.append("GPUs with more memory (--gpu-memory-gib)")
    return (f"ZeRO-{stage} does not fit: {_gib(s['total'])} GiB per GPU (model states {_gib(s['model_states'])}"
            f" + frozen {_gib(s['frozen'])} + activations {_gib(s['activations'])}) > {_gib(plan['budget_bytes'])}"
            f" GiB ({plan['gpu_memory_gib']:g} GiB less the {plan['margin']:.0%} margin) on {plan['nodes']} x "
            f"{plan['gpus_per_node']} GPUs; use " + ", or ".join(fixes))


def gpu_memory_gib() -> float | None:
    """The smallest GPU's memory on this node from ``nvidia-smi`` (no CUDA context is created), or None."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return min(float(x) for x in out.split()) / 1024 if out.split() else None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def hostfile_shape(path: str) -> tuple[int, int]:
    """``(gpus_per_node, nodes)`` from a DeepSpeed hostfile (``host slots=N`` lines; the smallest slots)."""
    hosts = [ln.split() for ln in Path(path).read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    slots = [int(w.split("=", 1)[1]) for h in hosts for w in h[1:] if w.startswith("slots=")]
    return (min(slots) if slots else 1), max(len(hosts), 1)


def record(cfg, ranks: int, on_cpu: bool, verifier: str, draft_vocab_size: int, aux_layer_ids: list[int],
           run_id: str, layer: dict | None = None) -> None:
    """Finetune's hook: plan the run about to launch, print it to stderr, log ``plan.json`` and the param
    ``plan.fits`` (true | false | unchecked, without a GPU | error). Never stops the launch."""
    import mlflow

    from draftline.tracking import log_params_once

    try:
        gpus, nodes = hostfile_shape(cfg.hostfile) if cfg.hostfile else (ranks, 1)
        config = verifier_config(verifier, draft_vocab_size=draft_vocab_size, aux_layer_ids=aux_layer_ids,
                                 layer=layer)
        plan = make_plan(config, gpus=gpus, nodes=nodes, gpu_memory_gib=None if on_cpu else gpu_memory_gib(),
                         tokens_per_batch=cfg.tokens_per_batch, ttt_steps=cfg.ttt_steps, precision=cfg.precision,
                         attn_impl=cfg.attn_impl, zero_stage=cfg.zero_stage,
                         name=f"verifier {verifier}, draft vocabulary {draft_vocab_size}")
    except Exception as e:  # noqa: BLE001 (an estimate must not stop a training run)
        print(f"[draftline] plan: not computed ({type(e).__name__}: {e})", file=sys.stderr)
        fits = "error"
    else:
        print(render(plan), file=sys.stderr)
        err = fit_error(plan, cfg.zero_stage)
        if err:
            print(f"[draftline] plan: WARNING {err}", file=sys.stderr)
        fits = "unchecked" if plan["fits"] is None else str(plan["fits"]).lower()
        mlflow.log_dict(plan, "plan.json")
    if "plan.fits" not in mlflow.get_run(run_id).data.params:  # a resumed run keeps its first plan's verdict
        log_params_once({"plan.fits": fits}, run_id)


def check(plan: dict, stage: int) -> None:
    """Raise :class:`DraftlineError` (exit 1) when ``stage`` does not fit."""
    err = fit_error(plan, stage)
    if err:
        raise DraftlineError(err)
