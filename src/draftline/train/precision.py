"""Which precision a finetune trains in: ``--precision auto`` measures instead of assuming.

On GPUs bf16 is the answer. On CPUs it depends on the chip: with AVX512-BF16 or AMX a bf16 matmul runs about
twice as fast as fp32 (2.1x on this project's 2-core AMD EPYC, 3.7x on an AMX machine), without them torch
falls back to a path ~100x slower. So ``auto`` times one matmul of the drafter's own shape (the MLP's
``[tokens, hidden] @ [hidden, intermediate]``, on one thread, as each CPU rank runs) in both precisions, a
fraction of a second, and trains in bf16 only when it is clearly faster. A whole training step gains less than
the matmul (bf16 argmax and softmax are slower on CPUs: here 1.26x per step for a 2.1x matmul), hence the margin.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

MARGIN = 1.3  # the bf16 matmul must be this much faster for a whole step to gain


@dataclass(frozen=True)
class Choice:
    precision: str  # bf16 | fp32
    reason: str  # one line, logged as the train.precision_choice param


def _matmul_s(dtype: torch.dtype, hidden: int, intermediate: int, tokens: int = 512, repeats: int = 5,
              give_up_s: float = float("inf")) -> float:
    """The best of ``repeats`` timings of one drafter-shaped matmul; stops early once one call takes longer than
    ``give_up_s`` (a dtype already known to lose needs no more timings)."""
    a = torch.randn(tokens, hidden, dtype=dtype)
    b = torch.randn(hidden, intermediate, dtype=dtype)
    t = time.perf_counter()
    a @ b  # the first call picks and warms the kernel
    if time.perf_counter() - t > 3 * give_up_s:
        return time.perf_counter() - t
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
        if best > give_up_s:
            break
    return best


def measure(hidden: int, intermediate: int) -> float:
    """fp32 time over bf16 time for one drafter-shaped matmul on one CPU thread (> 1: bf16 is faster). On a CPU
    without bf16 units (0.02x) the bf16 timing stops as soon as it is clearly slower, so the measurement stays a
    fraction of a second there too."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fp32 = min(_matmul_s(torch.float32, hidden, intermediate) for _ in range(2))
        slower = 2 * fp32  # bf16 at half fp32's speed or worse is no candidate: one timing tells
        first = _matmul_s(torch.bfloat16, hidden, intermediate, give_up_s=slower)
        bf16 = first if first > slower else min(first, _matmul_s(torch.bfloat16, hidden, intermediate))
    finally:
        torch.set_num_threads(threads)
    return fp32 / bf16


def choose(requested: str, *, on_cpu: bool, hidden: int, intermediate: int, resumed: Choice | None = None) -> Choice:
    """The precision to train in. An explicit bf16/fp32 is kept; a resumed run keeps the precision its
    checkpoints were written in; ``auto`` is bf16 on GPUs and, on CPUs, what :func:`measure` finds faster."""
    if resumed is not None and resumed.precision in ("bf16", "fp32") and requested in ("auto", resumed.precision):
        return resumed  # its checkpoints were written in it (another precision asked for is refused on resume)
    if requested != "auto":
        return Choice(requested, "asked for")
    if not on_cpu:
        return Choice("bf16", "auto: bf16 on GPUs")
    speedup = measure(hidden, intermediate)
    if speedup >= MARGIN:
        return Choice("bf16", f"auto: a bf16 matmul ran {speedup:.1f}x as fast as fp32 on this CPU")
    return Choice("fp32", f"auto: a bf16 matmul ran {speedup:.2f}x as fast as fp32 on this CPU "
                          f"(bf16 needs >= {MARGIN}x to pay)")
