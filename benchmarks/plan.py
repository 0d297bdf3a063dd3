"""plan: ``draftline plan`` for the mission's run, on its GPUs: both Kimi drafters (AQ-MedAI's Llama-layer Kimi-K2
one, lightseek's MLA Kimi-K2.5 one) on one node of 8 x RTX PRO 6000 Blackwell (95 GiB, PCIe 5.0), per ZeRO stage:
memory, what each stage sends a step beside the compute, the stage the plan picks, and the shards of 25,000
samples; the same drafters over NVLink for comparison; and how long planning takes (nothing is allocated: the
drafters are built on the meta device).

When ``results/train-step-real.json`` exists (a GPU run of ``train-step --shape real``: one rank, bf16, sdpa),
the plan for that run (its drafter shape from benchmarks.common, 1 GPU, its token count) is set beside the
measured peaks (``torch.cuda.max_memory_allocated``), so the estimate is checked against a real step.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
GIB = 1 << 30


def _row(s: dict, t: dict) -> str:
    return (f"{s['total'] / GIB:.2f} GiB = states {s['model_states'] / GIB:.2f} + frozen {s['frozen'] / GIB:.2f} "
            f"+ activations {s['activations'] / GIB:.2f}; fits: {s['fits']}; sends {t['sent_bytes'] / 1e9:.2f} GB "
            f"a step, {t['link_s'] * 1e3:.0f} ms")


def run(gpus: int = 8, tokens_per_batch: int = 4096, ttt_steps: int = 3) -> dict:
    from draftline.disk_space import human_bytes
    from draftline.train.plan import make_plan

    t0 = time.perf_counter()
    make_plan(gpus=1, gpu_memory_gib=None)  # imports (speculators, DeepSpeed) once
    t1 = time.perf_counter()
    plans = {layer: make_plan(layer=layer, gpus=gpus, tokens_per_batch=tokens_per_batch, ttt_steps=ttt_steps,
                              epochs=1.0) for layer in ("llama", "mla")}
    seconds = (time.perf_counter() - t1) / 2
    nvlink = {layer: make_plan(layer=layer, gpus=gpus, tokens_per_batch=tokens_per_batch, ttt_steps=ttt_steps,
                               epochs=1.0, link="nvlink") for layer in ("llama", "mla")}
    summary = {}
    for layer, plan in plans.items():
        name = "Llama layer (Kimi-K2)" if layer == "llama" else "MLA layer (Kimi-K2.5)"
        summary[f"{name} params (trainable/total)"] = f"{plan['trainable']:,} / {plan['params']:,}"
        for k, s in plan["stages"].items():
            summary[f"{name} ZeRO-{k} per GPU"] = _row(s, plan["interconnect"]["stages"][k])
        summary[f"{name} stage picked (PCIe)"] = f"ZeRO-{plan['recommended_stage']}: {plan['recommended_because']}"
        summary[f"{name} stage picked (NVLink)"] = f"ZeRO-{nvlink[layer]['recommended_stage']}"
    shards = plans["mla"]["storage"]
    summary["shards, 25,000 samples x 3,000 tokens"] = (f"{human_bytes(shards['bytes'])} "
                                                        f"({shards['bytes_per_token']:,} bytes a token, bf16)")
    summary["plan seconds (after imports)"] = f"{seconds:.2f}"
    summary["imports seconds"] = f"{t1 - t0:.1f}"
    gpu = plans["llama"]["gpu_memory_gib"]
    out = {"shape": "kimi", "device": "none: meta device", "plan_s": seconds, "plans": plans,
           "nvlink": {k: {"recommended_stage": v["recommended_stage"], "interconnect": v["interconnect"]}
                      for k, v in nvlink.items()},
           "summary": summary, "setup": f"1 node x {gpus} GPUs x {gpu:g} GiB, PCIe 5.0 (RTX PRO 6000 Blackwell)"}
    measured = RESULTS / "train-step-real.json"
    if measured.is_file():
        from benchmarks.common import drafter_config

        step = json.loads(measured.read_text())
        check = make_plan(drafter_config("real"), gpus=1, gpu_memory_gib=None, ttt_steps=3,
                          tokens_per_batch=step["tokens_per_step"], name="benchmarks.common real shape")
        out["against_train_step_real"] = {}
        for name, v in step.get("variants", {}).items():
            if name.startswith("zero") and "peak_gpu_mem_gib" in v:
                predicted = check["stages"][name.removeprefix("zero")]["total"] / GIB
                out["against_train_step_real"][name] = {"predicted_gib": predicted,
                                                         "measured_peak_gib": v["peak_gpu_mem_gib"]}
                summary[f"{name} 1 GPU predicted/measured"] = f"{predicted:.2f} / {v['peak_gpu_mem_gib']:.2f} GiB"
    return out
