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
import io
import math
from pathlib import Path
from typing import Any

from speculators.models.eagle3.model_definitions import model_classes

from draftline.data import storage
from draftline.drafter import layer_kinds
from draftline.drafter.model import meta_drafter
from draftline.drafter.shape import default_config, load_config
from draftline.errors import ConfigError, DraftlineError
from draftline.train import interconnect, phases
from draftline.train.plan_types import Activations, Plan, StageMemory

GIB = 1 << 30
DEFAULT_GPU_MEMORY_GIB = interconnect.DEFAULT_GPU_MEMORY_GIB
DEFAULT_SAMPLES, DEFAULT_TOKENS_PER_SAMPLE = storage.DEFAULT_SAMPLES, storage.DEFAULT_TOKENS_PER_SAMPLE
DEFAULT_MARGIN = 0.10
STAGES = (0, 1, 2, 3)
# parameters vLLM takes from the verifier, not from a drafter's checkpoint
SERVED_ELSEWHERE = ("embed_tokens.", "verifier_lm_head.", "verifier_norm.")
def count_params(config) -> dict[str, Any]:
    """Exact parameter counts of the drafter ``config`` describes, built on the meta device."""
    tl = config.transformer_layer_config
    if tl.model_type not in model_classes:
        raise ConfigError(f"speculators builds EAGLE-3 layers for {', '.join(sorted(model_classes))} only; this "
                          f"drafter's layer config is {tl.model_type!r}")
    model = meta_drafter(config)
    trainable = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p.numel() for n, p in model.named_parameters() if not p.requires_grad}

    def largest(want: bool) -> tuple[str, int]:  # DeepSpeed's "layer": a module's own parameters
        sizes = {name or "(model)": sum(p.numel() for p in m.parameters(recurse=False) if p.requires_grad == want)
                 for name, m in model.named_modules()}
        return max(sizes.items(), key=lambda kv: kv[1])

    (l_name, l_params), (f_name, f_params) = largest(True), largest(False)
    mlp = tl.intermediate_size
    every = {**trainable, **frozen}
    served = sum(v for n, v in every.items() if not n.startswith(SERVED_ELSEWHERE))
    fc = sum(v for n, v in trainable.items() if n.startswith("fc."))
    return {
        "parts": {"fc": fc, "layer": sum(trainable.values()) - fc},
        "total": sum(trainable.values()) + sum(frozen.values()),
        "trainable": sum(trainable.values()),
        "frozen": sum(frozen.values()),
        # what the exported checkpoint holds (vLLM shares the verifier's embeddings): the size drafters are quoted at
        "checkpoint": served, "checkpoint_with_embeddings": served + every.get("embed_tokens.weight", 0),
        "frozen_names": sorted(n.removesuffix(".weight") for n in frozen),
        "largest_layer": {"name": l_name, "params": l_params},
        "largest_frozen_layer": {"name": f_name, "params": f_params},
        "buffer_bytes": sum(b.numel() * b.element_size() for _, b in model.named_buffers()),
        "shape": {"hidden_size": model.hidden_size, "intermediate_size": mlp,
                  "num_attention_heads": tl.num_attention_heads,
                  "num_key_value_heads": tl.num_key_value_heads,
                  "head_dim": _qk_head_dim(tl, model.hidden_size), "latent": _latent_width(tl),
                  "layer": layer_kinds.of_layer(tl.to_dict()).served.name,
                  "draft_vocab_size": model.draft_vocab_size, "verifier_vocab_size": tl.vocab_size,
                  "num_aux": model.fc.in_features // model.hidden_size, "layers": tl.num_hidden_layers},
    }


def _qk_head_dim(tl, hidden: int) -> int:
    """The width of one query/key head: MLA's nope + rope parts, else ``head_dim``."""
    if getattr(tl, "kv_lora_rank", None) is not None:
        return int(tl.qk_nope_head_dim + tl.qk_rope_head_dim)
    return int(getattr(tl, "head_dim", None) or hidden // tl.num_attention_heads)


def _latent_width(tl) -> int:
    """Per token, what MLA's low-rank projections keep for the backward beyond a Llama layer's: the query LoRA
    output and its norm, the compressed KV (and its rope part) and its norm, and ``kv_b_proj``'s per-head keys and
    values; 0 for a Llama layer."""
    if getattr(tl, "kv_lora_rank", None) is None:
        return 0
    q_lora = 2 * (tl.q_lora_rank or 0)
    kv = 2 * (tl.kv_lora_rank + tl.qk_rope_head_dim)
    return int(q_lora + kv + tl.num_attention_heads * (tl.qk_nope_head_dim + tl.v_head_dim))


def activation_bytes(shape: dict[str, int], tokens: int, ttt_steps: int, precision: str = "bf16",
                     attn_impl: str = "sdpa") -> Activations:
    """An estimate of the activation memory of one forward+backward over ``tokens`` packed tokens: what autograd
    keeps for the backward in speculators' forward with draftline's one-pass KL loss (drafter/loss.py), plus the
    inputs and target logits alive meanwhile. b is 2 (bf16) or 4 (fp32), H hidden, I intermediate, V draft vocabulary, q and kv
    the query and key/value widths (heads x head_dim), d head_dim, k ``ttt_steps``, T ``tokens``. Per token:

    * per TTT step: 4 RMSNorms x (4H fp32 copy + bH output), the q/k/v input b*2H, q, the attention output
      and its o_proj copy b*3q, the MLP's gate/up/activation/product b*4I, rotary cos/sin b*2d, the loss's
      fp32 gradient 4V (the three layer terms per layer); an MLA layer also its low-rank projections' outputs
      b*latent (:func:`_latent_width`; d is then the query/key head width, nope + rope);
    * keys and values, concatenated over the steps (step j attends to (j+1)T keys): b*2kv * k(k+1)/2, where
      kv is q for ``sdpa``/``eager`` (with a mask, transformers repeats grouped K/V heads before attention);
    * once: the fc input b*num_aux*H, the verifier's last hidden state b*H, the target logits b*V, their fp32
      log-probabilities and probabilities 8V (computed once for every draft position), and, when K/V heads are
      repeated, the cache itself b*2kv*k;
    * transient: the next logits, bV.

    Plus, over the whole batch, T^2 * k(k+1)/2 x (2 for ``sdpa``'s dense bf16 masks, or (4 + b) x heads for
    ``eager``'s materialised attention probabilities); ``simple_flex_attention`` has neither. ``blockwise``
    (:mod:`draftline.drafter.attention`) keeps one sample's probabilities per step, fp32 and in b, and its causal
    mask: k x ((4 + b) x heads + 1) x T^2 for a pack that is one sample (the most; four samples keep a quarter),
    plus each later step's diagonal keys and values, b*2q * k(k-1)/2 per token. Checked on the CPU
    against the tensors autograd saves (``torch.autograd.graph.saved_tensors_hooks``) for a scaled-down drafter:
    within 0.1% for sdpa and eager (tests/unit/train/test_plan.py). Not counted: gradients of activations during the
    backward (transient, one layer's worth at a time) and kernel workspaces; the margin covers them."""
    b = 2 if precision == "bf16" else 4
    h, i, v, d = shape["hidden_size"], shape["intermediate_size"], shape["draft_vocab_size"], shape["head_dim"]
    q, kv = shape["num_attention_heads"] * d, shape["num_key_value_heads"] * d
    layers, tri = shape.get("layers", 1), ttt_steps * (ttt_steps + 1) // 2
    norm = 4 * h + b * h
    per_step = layers * (3 * norm + b * (2 * h + 3 * q + 4 * i + shape.get("latent", 0))) + norm + b * 2 * d + 4 * v
    repeated = attn_impl != "simple_flex_attention" and kv < q
    kv_cache = layers * b * 2 * (q if repeated else kv) * tri
    if attn_impl == "blockwise":  # each later step's diagonal keys and values, gathered per sample
        kv_cache += layers * b * 2 * q * (tri - ttt_steps)
    once = b * (shape["num_aux"] * h + h + v) + 8 * v + (layers * b * 2 * kv * ttt_steps if repeated else 0)
    transient = b * v
    per_token = ttt_steps * per_step + kv_cache + once + transient
    heads = shape["num_attention_heads"]
    if attn_impl == "blockwise":  # per step, one sample's scores: fp32 softmax + its weights, and the causal mask
        quadratic = layers * ttt_steps * ((4 + b) * heads + 1) * tokens * tokens + \
            layers * (4 + b) * heads * tokens * (tri - ttt_steps)
    else:
        # an MLA layer's query/key heads (nope + rope) are wider than its value heads: PyTorch's CPU sdpa then
        # takes its math path, which keeps the probabilities as eager does (counted: an upper bound on GPUs)
        unequal = (4 + b) * heads if layer_kinds.named(str(shape.get("layer", "llama"))).unequal_heads else 0
        dense = {"simple_flex_attention": 0, "sdpa": 2 + unequal, "eager": (4 + b) * heads}
        quadratic = layers * dense.get(attn_impl, 2) * tokens * tokens * tri
    return Activations(bytes=tokens * per_token + quadratic, bytes_per_token=per_token, quadratic=quadratic,
                       attn_impl=attn_impl,
                       formula="tokens x (ttt_steps x per_step + kv_cache + once + transient) + masks/scores",
                       per_step=per_step, kv_cache=kv_cache, once=once, transient=transient)


def _fp32_model_states(stage: int, p: int, largest: int, n: int) -> tuple[int, str]:
    """fp32 training (no 16-bit copies, no master weights): params 4, grads 4, Adam 8 bytes per parameter."""
    formula = {0: (16 * p, "16P"), 1: (8 * p + 8 * p // n, "8P + 8P/N"), 2: (4 * p + 12 * p // n, "4P + 12P/N"),
               3: (8 * largest + 16 * p // n, "8L + 16P/N")}[stage]
    return formula[0], f"fp32 (DeepSpeed's estimators assume 16-bit): {formula[1]}"


def model_state_bytes(counts: dict, stage: int, gpus: int, nodes: int, precision: str = "bf16") -> dict[str, Any]:
    """Per-GPU bytes of one stage's model states (trainable) and frozen parameters, and where the number is
    from."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs  # noqa: PLC0415 (deepspeed: slow, and prints an accelerator warning at import)
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs  # noqa: PLC0415 (deepspeed: slow, and prints an accelerator warning at import)

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
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_cold  # noqa: PLC0415 (deepspeed: slow, and prints an accelerator warning at import)
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs_all_cold  # noqa: PLC0415 (deepspeed: slow, and prints an accelerator warning at import)

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print("ZeRO-2:")
        estimate_zero2_model_states_mem_needs_all_cold(counts["trainable"], num_gpus_per_node=gpus, num_nodes=nodes)
        print("ZeRO-3:")
        estimate_zero3_model_states_mem_needs_all_cold(counts["trainable"], counts["largest_layer"]["params"],
                                                       num_gpus_per_node=gpus, num_nodes=nodes)
    return out.getvalue()


def _max_tokens(room: int, acts: Activations, tokens: int) -> int:
    """The most tokens per batch whose activations fit in ``room`` bytes (a*T + c*T^2 <= room)."""
    a, c = acts["bytes_per_token"], acts["quadratic"] / tokens**2
    if room <= 0:
        return 0
    return int(room // a) if not c else int((-a + math.sqrt(a * a + 4 * c * room)) / (2 * c))


def make_plan(config=None, *, gpus: int = 8, nodes: int = 1, gpu_memory_gib: float | None = DEFAULT_GPU_MEMORY_GIB,
              tokens_per_batch: int = 4096, ttt_steps: int = 3, precision: str = "bf16", attn_impl: str = "sdpa",
              margin: float = DEFAULT_MARGIN, zero_stage: int | None = None, name: str | None = None,
              layer: str = "llama", draft_vocab_size: int | None = None, link: str = "pcie",
              link_gb_s: float | None = None, gpu_tflops: float | None = interconnect.DEFAULT_TFLOPS,
              samples: int = DEFAULT_SAMPLES, tokens_per_sample: int = DEFAULT_TOKENS_PER_SAMPLE,
              verifier: str | Path | None = None, epochs: float | None = None, steps: int = 200,
              reply_tokens: int | None = None,
              assumptions: phases.Assumptions = phases.Assumptions()) -> Plan:
    """The memory plan (JSON-serialisable) for a drafter: ``config`` is ``None`` (the real Kimi drafter of
    ``layer``: AQ-MedAI's Llama-layer Kimi-K2 one, or lightseek's MLA Kimi-K2.5 one, with ``draft_vocab_size``
    if given), a
    drafter directory or config.json, its contents, or a speculators config. ``gpu_memory_gib=None``: the fit
    is not checked (``fits`` is None). ``zero_stage`` marks the stage that will be used. A stage that does not
    fit says the most ``tokens_per_batch`` and the fewest GPUs (up to 4096) with which it would. ``verifier`` (its
    directory or config.json): the shards are sized from its hidden size, which must be the drafter's."""
    if gpus < 1 or nodes < 1 or tokens_per_batch < 1 or ttt_steps < 1 or not 0 <= margin < 1:
        raise ConfigError(f"plan needs gpus>=1, nodes>=1, tokens_per_batch>=1, ttt_steps>=1, 0<=margin<1 (got "
                          f"gpus={gpus}, nodes={nodes}, tokens_per_batch={tokens_per_batch}, "
                          f"ttt_steps={ttt_steps}, margin={margin})")
    if samples < 1 or tokens_per_sample < 1:
        raise ConfigError(f"plan needs samples>=1 and tokens_per_sample>=1 (got {samples}, {tokens_per_sample})")
    if link not in interconnect.LINKS:
        raise ConfigError(f"interconnect must be one of {', '.join(interconnect.LINKS)}, got {link!r}")
    if precision not in ("bf16", "fp32"):
        raise ConfigError(f"precision must be bf16 or fp32, got {precision!r}")
    if zero_stage is not None and zero_stage not in STAGES:
        raise ConfigError(f"zero_stage must be one of 0-3, got {zero_stage}")

    if config is None:
        config = default_config(layer, draft_vocab_size)
        name = name or layer_kinds.named(layer).reference_name
    elif isinstance(config, (str, Path, dict)):
        name = name or (str(config) if not isinstance(config, dict) else "drafter config")
        config = load_config(config)
    name = name or "drafter config"
    counts = count_params(config)
    acts = activation_bytes(counts["shape"], tokens_per_batch, ttt_steps, precision, attn_impl)
    budget = None if gpu_memory_gib is None else int(gpu_memory_gib * GIB * (1 - margin))
    stages: dict[str, StageMemory] = {}
    for stage in STAGES:
        ms = model_state_bytes(counts, stage, gpus, nodes, precision)
        total = ms["model_states"] + ms["frozen"] + acts["bytes"]
        st = stages[str(stage)] = StageMemory(model_states=ms["model_states"], frozen=ms["frozen"],
                                              source=ms["source"], activations=acts["bytes"], total=total,
                                              fits=None if budget is None else total <= budget,
                                              headroom=None if budget is None else budget - total)
        if st["fits"] is False and budget is not None:
            st["max_tokens_per_batch"] = _max_tokens(budget - ms["model_states"] - ms["frozen"], acts,
                                                     tokens_per_batch)
            st["min_gpus"] = next((n for n in range(gpus * nodes + 1, 4097) if stage > 0 and sum(
                model_state_bytes(counts, stage, n, 1, precision)[k] for k in ("model_states", "frozen"))
                + acts["bytes"] <= budget), None)
    moved = interconnect.traffic(counts, list(STAGES), gpus=gpus * nodes, tokens=tokens_per_batch,
                                 ttt_steps=ttt_steps, precision=precision, link=link, link_gb_s=link_gb_s,
                                 gpu_tflops=gpu_tflops)
    best, why = interconnect.pick_stage(stages, moved)
    by_storage = _shards(counts["shape"], verifier, samples, tokens_per_sample)
    shards = by_storage["bf16"]  # the default storage
    chosen = zero_stage if zero_stage is not None else best
    link_s = moved["stages"][str(chosen)]["link_s"] if chosen is not None else 0.0
    step_s = max(moved["compute_s"], link_s) if moved["compute_s"] else None  # DeepSpeed overlaps the two
    run = phases.phases(samples=samples, tokens_per_sample=tokens_per_sample,
                        reply_tokens=reply_tokens or tokens_per_sample, epochs=epochs, steps=steps, gpus=gpus, nodes=nodes,
                        tokens_per_batch=tokens_per_batch, step_s=step_s, bytes_per_token=shards.bytes_per_token,
                        assumptions=assumptions)
    return Plan(
        drafter=name, params=counts["total"], trainable=counts["trainable"], frozen=counts["frozen"],
        checkpoint_params=counts["checkpoint"], checkpoint_params_with_embeddings=counts["checkpoint_with_embeddings"],
        frozen_names=counts["frozen_names"], largest_layer=counts["largest_layer"],
        largest_frozen_layer=counts["largest_frozen_layer"], shape=counts["shape"],
        gpus_per_node=gpus, nodes=nodes, gpu_memory_gib=gpu_memory_gib, margin=margin,
        budget_bytes=budget, tokens_per_batch=tokens_per_batch, ttt_steps=ttt_steps,
        precision=precision, zero_stage=zero_stage, activations=acts, stages=stages,
        fits=None if zero_stage is None else stages[str(zero_stage)]["fits"],
        deepspeed_estimators=_deepspeed_reports(counts, gpus, nodes),
        interconnect=moved, recommended_stage=best, recommended_because=why,
        verifier=None if verifier is None else str(verifier),
        run=run,
        storage={**shards.as_dict(), "needed_bytes": shards.needed, "offered": list(storage.HIDDEN_BYTES),
                 "bytes_by_storage": {kind: plan.bytes for kind, plan in by_storage.items()}},
    )


def _shards(shape: dict, verifier: str | Path | None, samples: int,
            tokens_per_sample: int) -> dict[str, storage.StoragePlan]:
    """The shards prepare will write for this drafter's verifier (checked to be as wide as the drafter), in each
    storage it offers."""
    if verifier is not None:
        hidden, verifier_name = storage.verifier_hidden_size(verifier)
        if hidden != shape["hidden_size"]:
            raise ConfigError(f"verifier {verifier_name} has hidden size {hidden}, the planned drafter "
                              f"{shape['hidden_size']}: pass --drafter with a drafter of that verifier")
    return {kind: storage.shard_bytes(shape["hidden_size"], shape["num_aux"], tokens=samples * tokens_per_sample,
                                      samples=samples, tokens_source=f"assumed: {tokens_per_sample:,} tokens a sample",
                                      storage=kind) for kind in storage.HIDDEN_BYTES}


def gib(n: int | None, unit: int = GIB) -> str:
    return "-" if n is None else f"{n / unit:.2f}"


def fit_error(plan: Plan, stage: int) -> str | None:
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
    return (f"ZeRO-{stage} does not fit: {gib(s['total'])} GiB per GPU (model states {gib(s['model_states'])}"
            f" + frozen {gib(s['frozen'])} + activations {gib(s['activations'])}) > {gib(plan['budget_bytes'])}"
            f" GiB ({plan['gpu_memory_gib']:g} GiB less the {plan['margin']:.0%} margin) on {plan['nodes']} x "
            f"{plan['gpus_per_node']} GPUs; use " + ", or ".join(fixes))


def check(plan: Plan, stage: int) -> None:
    """Raise :class:`DraftlineError` (exit 1) when ``stage`` does not fit."""
    err = fit_error(plan, stage)
    if err:
        raise DraftlineError(err)
