"""step-profile: where one drafter training step's time goes, beside what this machine's matmuls can do, and
what each change to the step buys, side by side.

One step as a rank runs it (speculators' forward over ``ttt`` draft positions, the KL loss, backward, AdamW and
gradient clipping), on one process with ``--threads`` threads (1: a rank of the real tier, two ranks on two
cores), profiled with ``torch.profiler``: the share of the step in each kind of operator (matmuls, attention,
loss and softmax, optimizer, elementwise, copies and casts, indexing), the FLOPs the profiler counts in matmuls,
and the achieved FLOP/s against the bf16 and fp32 matmul peak measured in the same run (a [T, H] x [H, 4H] GEMM
at the drafter's own width).

Variants, timed in interleaved rounds (each round times one step of every variant, so a machine that slows down
moves them all; ratios are per round against ``before``, median and range):

- ``before``: speculators' eager KL loss, PyTorch's own argmax, ``sdpa`` (the step before this benchmark's
  changes);
- ``onepass-loss``: the loss finetune trains with (:mod:`draftline.drafter.loss`);
- ``argmax-by-max``: and bf16 argmax by ``max`` (:mod:`draftline.drafter.fast_ops`);
- ``blockwise``: the step finetune runs on CPU ranks: and the ``blockwise`` draft attention
  (:mod:`draftline.drafter.attention`: per packed sample, the draft positions' keys as diagonals);
- ``blockwise+micro<m>``: the same tokens split into ``m`` micro-batches with their gradients accumulated
  (``finetune --micro-batch-tokens``, off by default: under ZeRO-2 on two ranks each micro-batch's gradient
  reduction costs what the smaller packs save).

Each batch packs four samples (the real tier's SmolLM2 samples average ~280 tokens: about four to a 1 024-token
pack).

``--shape smollm2`` is the SmolLM2-135M drafter the real tier trains (hidden 576, MLP 1536, 9 heads, draft
vocabulary 8192); ``tiny`` the tests' drafter.
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks.common import SHAPES, bench_model, fake_batch
from draftline.drafter.attention import NAME as BLOCKWISE

KINDS = (  # first match wins
    ("attention", ("scaled_dot_product", "_flash_attention", "_efficient_attention", "baddbmm", "bmm")),
    ("matmul", ("aten::mm", "aten::addmm", "aten::matmul", "aten::linear")),
    ("loss+softmax", ("softmax", "kl_div", "log_softmax", "xlogy", "argmax")),
    ("optimizer", ("_foreach", "adam", "clip_grad", "norm")),
    ("copy+cast", ("aten::copy_", "aten::to", "aten::_to_copy", "aten::clone", "aten::contiguous", "aten::cat")),
    ("indexing+mask", ("index", "gather", "scatter", "masked", "where", "embedding", "eq", "arange")),
    ("elementwise", ("aten::mul", "aten::add", "aten::sub", "aten::div", "aten::neg", "aten::pow", "aten::rsqrt",
                     "aten::mean", "aten::sum", "aten::silu", "aten::exp", "aten::sigmoid", "aten::fill_",
                     "aten::zero_", "aten::cos", "aten::sin")),
)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak(dtype: torch.dtype, rows: int, hidden: int, reps: int = 6, device: str = "cpu") -> float:
    """TFLOP/s of a [rows, hidden] x [hidden, 4 hidden] GEMM on all threads (the best of ``reps``)."""
    dev = torch.device(device)
    a = torch.randn(rows, hidden, dtype=dtype, device=dev)
    b = torch.randn(hidden, 4 * hidden, dtype=dtype, device=dev)
    a @ b
    best = float("inf")
    for _ in range(reps):
        _sync(dev)
        t = time.perf_counter()
        a @ b
        _sync(dev)
        best = min(best, time.perf_counter() - t)
    return 2 * rows * hidden * 4 * hidden / best / 1e12


def _kind(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k.lower() in low for k in keys):
            return kind
    return "other"


def _step(model, batches, ttt: int, cfg, plain: bool):
    from draftline.drafter.model import forward, trainable_parameters

    params = trainable_parameters(model)
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95))

    def run(batch):
        if plain:  # speculators' forward as it is, PyTorch's argmax
            _, loss, _ = model(**batch, ttt_steps=ttt, loss_config=cfg)
            return loss
        return forward(model, batch, ttt, cfg)[0]

    def step():
        opt.zero_grad(set_to_none=True)
        for batch in batches:  # gradients accumulated over the micro-batches, as DeepSpeed accumulates them
            (run(batch) / len(batches)).backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
    return step


def _variant(shape: str, tokens: int, micro: int, loss: str, plain: bool, attn: str, dtype: torch.dtype,
             device: torch.device, ttt: int = 3):
    from speculators.losses import resolve_loss_config

    from draftline.drafter.model import loss_config

    model = bench_model(shape, device, dtype=dtype, attn=attn)
    per = tokens // micro
    batches = [{k: v.to(dtype) if v.is_floating_point() else v for k, v in fake_batch(model, per, device, seed=i).items()}
               for i in range(micro)]
    cfg = resolve_loss_config("kl_div", "eager") if loss == "eager" else loss_config()
    step = _step(model, batches, ttt, cfg, plain)
    step()  # warm-up
    _sync(device)
    return step, sum(int(b["input_ids"].numel()) for b in batches), _profile(step, device)


def _profile(step, device: torch.device) -> tuple[dict, float]:
    """Shares of one profiled step (the device's kernel time on a GPU) and the matmul FLOPs it counted. Taken
    right after the variant's warm-up: on a CPU a step profiled after many others' spends far longer in the
    loss's large float32 temporaries (the allocator's state; timings outside the profiler do not move)."""
    cuda = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities, with_flops=True) as prof:
        step()
        _sync(device)
    shares: dict[str, float] = {}
    flops = 0.0
    for e in prof.key_averages():
        took = e.self_device_time_total if cuda else e.self_cpu_time_total
        shares[_kind(e.key)] = shares.get(_kind(e.key), 0.0) + took
        flops += e.flops or 0
    total = sum(shares.values()) or 1.0
    return {k: round(v / total, 3) for k, v in sorted(shares.items(), key=lambda kv: -kv[1])}, flops


VARIANTS = {  # name: micro-batches, loss, speculators' forward as it is (PyTorch's argmax), attention
    "before": (1, "eager", True, "sdpa"), "onepass-loss": (1, "onepass", True, "sdpa"),
    "argmax-by-max": (1, "onepass", False, "sdpa"), "blockwise": (1, "onepass", False, BLOCKWISE)}


def run(shape: str = "smollm2", tokens: int = 1024, rounds: int = 5, threads: int = 1,
        micro: tuple[int, ...] = (2,), device: str = "cpu", variants: tuple[str, ...] = tuple(VARIANTS)) -> dict:
    """``variants`` (of :data:`VARIANTS`, ``before`` always) and ``blockwise+micro<m>`` for each ``micro``."""
    torch.manual_seed(0)
    dev = torch.device(device)
    if dev.type == "cpu":
        torch.set_num_threads(threads)
    h = SHAPES[shape]["hidden_size"]
    peak = {"bf16": round(matmul_peak(torch.bfloat16, tokens, h, device=device), 3),
            "fp32": round(matmul_peak(torch.float32, tokens, h, device=device), 3)}
    dtype = torch.bfloat16 if peak["bf16"] > peak["fp32"] else torch.float32
    plan = {name: VARIANTS[name] for name in ("before", *variants) if name in VARIANTS}
    plan.update({f"blockwise+micro{m}": (m, "onepass", False, BLOCKWISE) for m in micro if tokens % m == 0})
    steps = {name: _variant(shape, tokens, m, loss, plain, attn, dtype, dev)
             for name, (m, loss, plain, attn) in plan.items()}
    times: dict[str, list[float]] = {name: [] for name in plan}
    for _ in range(rounds):
        for name, (step, _tokens, _prof) in steps.items():
            _sync(dev)
            t = time.perf_counter()
            step()
            _sync(dev)
            times[name].append(time.perf_counter() - t)
    variants = {}
    for name, (_step, real, (share, flops)) in steps.items():
        step_s = statistics.median(times[name])
        per_round = [b / x for x, b in zip(times[name], times["before"], strict=True)]
        variants[name] = {
            "dtype": {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype], "tokens": real,
            "micro_batches": plan[name][0], "loss": plan[name][1], "argmax": "pytorch" if plan[name][2] else "max",
            "attention": plan[name][3],
            "step_s_median": round(step_s, 3), "step_s_spread": [round(min(times[name]), 3), round(max(times[name]), 3)],
            "tokens_per_s": round(real / step_s, 1),
            "speedup": {"median": round(statistics.median(per_round), 2),
                        "range": [round(min(per_round), 2), round(max(per_round), 2)]},
            "share": share, "profiled_matmul_gflop": round(flops / 1e9, 2),
            "achieved_tflops": round(flops / step_s / 1e12, 3)}
        variants[name]["of_peak"] = round(variants[name]["achieved_tflops"] / peak[variants[name]["dtype"]], 3)
    where = f"{threads} thread(s)" if dev.type == "cpu" else torch.cuda.get_device_name(dev)
    summary = {"matmul peak bf16 / fp32 TFLOP/s": f"{peak['bf16']} / {peak['fp32']} ({where})",
               **{f"{k} tokens/s": f"{v['tokens_per_s']} (x{v['speedup']['median']} "
                  f"[{v['speedup']['range'][0]}, {v['speedup']['range'][1]}] vs before; top: "
                  f"{', '.join(f'{n} {s:.0%}' for n, s in list(v['share'].items())[:3])})"
                  for k, v in variants.items()}}
    return {"shape": shape, "device": str(dev), "threads": threads, "tokens_per_step": tokens, "rounds": rounds,
            "matmul_peak_tflops": peak, "by_variant": variants, "summary": summary}
