"""plan: ``draftline plan`` for the real Kimi-K2 EAGLE-3 drafter on one node of 8 x 180 GiB (B200), per ZeRO
stage, and how long planning takes (nothing is allocated: the drafter is built on the meta device).

When ``results/train-step-real.json`` exists (a GPU run of ``train-step --shape real``: one rank, bf16, sdpa),
the plan for that run (its drafter shape from benchmarks.common, 1 GPU, its token count) is set beside the
measured peaks (``torch.cuda.max_memory_allocated``), so the estimate is checked against a real step.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def _row(s: dict) -> str:
    gib = 1 << 30
    return (f"{s['total'] / gib:.2f} GiB = states {s['model_states'] / gib:.2f} + frozen {s['frozen'] / gib:.2f} "
            f"+ activations {s['activations'] / gib:.2f}; fits: {s['fits']}")


def run(gpus: int = 8, gpu_memory_gib: float = 180.0, tokens_per_batch: int = 4096, ttt_steps: int = 3) -> dict:
    from draftline.train.plan import make_plan

    t0 = time.perf_counter()
    make_plan(gpus=1, gpu_memory_gib=None)  # imports (speculators, DeepSpeed) once
    t1 = time.perf_counter()
    plan = make_plan(gpus=gpus, gpu_memory_gib=gpu_memory_gib, tokens_per_batch=tokens_per_batch,
                     ttt_steps=ttt_steps)
    seconds = time.perf_counter() - t1
    summary = {"params (trainable/total)": f"{plan['trainable']:,} / {plan['params']:,}",
               **{f"ZeRO-{k} per GPU": _row(s) for k, s in plan["stages"].items()},
               "plan seconds (after imports)": f"{seconds:.2f}", "imports seconds": f"{t1 - t0 - seconds:.1f}"}
    out = {"shape": "kimi-k2", "device": "none: meta device", "plan_s": seconds, "plan": plan, "summary": summary,
           "setup": f"1 node x {gpus} GPUs x {gpu_memory_gib:g} GiB"}
    measured = RESULTS / "train-step-real.json"
    if measured.is_file():
        from benchmarks.common import drafter_config

        step = json.loads(measured.read_text())
        check = make_plan(drafter_config("real"), gpus=1, gpu_memory_gib=None, ttt_steps=3,
                          tokens_per_batch=step["tokens_per_step"], name="benchmarks.common real shape")
        out["against_train_step_real"] = {}
        for name, v in step.get("variants", {}).items():
            if name.startswith("zero") and "peak_gpu_mem_gib" in v:
                predicted = check["stages"][name.removeprefix("zero")]["total"] / (1 << 30)
                out["against_train_step_real"][name] = {"predicted_gib": predicted,
                                                         "measured_peak_gib": v["peak_gpu_mem_gib"]}
                summary[f"{name} 1 GPU predicted/measured"] = f"{predicted:.2f} / {v['peak_gpu_mem_gib']:.2f} GiB"
    return out
