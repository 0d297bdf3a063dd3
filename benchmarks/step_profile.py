"""step-profile: where one drafter training step's time goes, beside what this machine's matmuls can do.

One step as a rank runs it (speculators' forward over ``ttt`` draft positions, the KL loss, backward, AdamW and
gradient clipping), on one process, profiled with ``torch.profiler``: the share of the step in each kind of
operator (matmuls, attention, loss and softmax, optimizer, elementwise, copies and casts, indexing), the
FLOPs the profiler counts in matmuls, and the achieved FLOP/s against the bf16 and fp32 matmul peak measured in
the same run (a [T, H] x [H, 4H] GEMM at the drafter's own width, all threads).

``--shape smollm2`` is the SmolLM2-135M drafter the real tier trains (hidden 576, MLP 1536, 9 heads, draft
vocabulary 8192); ``tiny`` the tests' drafter. ``micro`` splits the step's tokens into that many micro-batches
with their gradients accumulated (the same tokens per optimizer step): the packed attention of speculators costs
T x (k T) per draft position, so smaller micro-batches cut its share.
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks.common import SHAPES, bench_model, fake_batch

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


def matmul_peak(dtype: torch.dtype, rows: int, hidden: int, reps: int = 6) -> float:
    """TFLOP/s of a [rows, hidden] x [hidden, 4 hidden] GEMM on all threads (the best of ``reps``)."""
    a, b = torch.randn(rows, hidden, dtype=dtype), torch.randn(hidden, 4 * hidden, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * rows * hidden * 4 * hidden / best / 1e12


def _kind(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k.lower() in low for k in keys):
            return kind
    return "other"


def _step(model, batches, ttt: int):
    from draftline.drafter.model import forward, loss_config, trainable_parameters

    params = trainable_parameters(model)
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95))
    cfg = loss_config()

    def step():
        opt.zero_grad(set_to_none=True)
        for batch in batches:  # gradients accumulated over the micro-batches, as DeepSpeed accumulates them
            loss, _ = forward(model, batch, ttt, cfg)
            (loss / len(batches)).backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
    return step


def profile(shape: str, tokens: int, micro: int, dtype: torch.dtype, iters: int, ttt: int = 3) -> dict:
    model = bench_model(shape, "cpu", dtype=dtype)
    per = tokens // micro
    batches = [{k: v.to(dtype) if v.is_floating_point() else v for k, v in fake_batch(model, per, "cpu", seed=i).items()}
               for i in range(micro)]
    step = _step(model, batches, ttt)
    step()  # warm-up
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_flops=True) as prof:
        step()
    shares: dict[str, float] = {}
    flops = 0.0
    for e in prof.key_averages():
        shares[_kind(e.key)] = shares.get(_kind(e.key), 0.0) + e.self_cpu_time_total
        flops += e.flops or 0
    total = sum(shares.values()) or 1.0
    step_s = statistics.median(times)
    real = sum(int(b["input_ids"].numel()) for b in batches)
    return {"dtype": {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype], "tokens": real, "micro_batches": micro,
            "step_s_median": round(step_s, 3), "step_s_spread": [round(min(times), 3), round(max(times), 3)],
            "tokens_per_s": round(real / step_s, 1),
            "share": {k: round(v / total, 3) for k, v in sorted(shares.items(), key=lambda kv: -kv[1])},
            "profiled_matmul_gflop": round(flops / 1e9, 2),
            "achieved_tflops": round(flops / step_s / 1e12, 3)}


def run(shape: str = "smollm2", tokens: int = 4096, iters: int = 3, micro: tuple[int, ...] = (1, 4)) -> dict:
    torch.manual_seed(0)
    h = SHAPES[shape]["hidden_size"]
    peak = {"bf16": round(matmul_peak(torch.bfloat16, tokens, h), 3),
            "fp32": round(matmul_peak(torch.float32, tokens, h), 3)}
    dtype = torch.bfloat16 if peak["bf16"] > peak["fp32"] else torch.float32
    variants = {f"micro{m}": profile(shape, tokens, m, dtype, iters) for m in micro}
    base = variants[f"micro{micro[0]}"]["tokens_per_s"]
    for v in variants.values():
        v["speedup"] = round(v["tokens_per_s"] / base, 2)
        v["of_peak"] = round(v["achieved_tflops"] / peak[v["dtype"]], 3)
    summary = {"matmul peak bf16 / fp32 TFLOP/s": f"{peak['bf16']} / {peak['fp32']}",
               **{f"{k} tokens/s": f"{v['tokens_per_s']} (x{v['speedup']}; top: "
                  f"{', '.join(f'{n} {s:.0%}' for n, s in list(v['share'].items())[:3])})"
                  for k, v in variants.items()}}
    return {"shape": shape, "threads": torch.get_num_threads(), "matmul_peak_tflops": peak, "by_micro_batches": variants,
            "summary": summary}
