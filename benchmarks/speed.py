"""speed: what a drafter buys, as ``draftline evaluate`` measures it on vLLM: the same prompts decoded with the
drafter and with the verifier alone, wave by wave (alternating on a CPU host), at each concurrency; tokens/s,
time per output token, latency and the speed-up with its paired interval over waves.

``--shape kimi``: the Kimi-shaped miniature (``./demo_kimi.sh`` first: its MLA finetune run and evaluation set
in ``mlflow.db``); ``--shape smollm2``: the real tier (``./demo_real.sh`` first: its child finetune run, from
``work/real/summary.json``, and its GSM8K evaluation set); or pass ``--target`` and ``--data`` for any drafter and
evaluation set. ``--sweep-k 1..3`` also measures each k and names the fastest (``evaluate --sweep-k``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from benchmarks.demo_runs import latest_run


def _drafter(shape: str) -> str:
    if shape == "smollm2":
        summary = Path("work/real/summary.json")
        if not summary.is_file():
            raise SystemExit("no work/real/summary.json: run ./demo_real.sh first")
        return f"runs:/{json.loads(summary.read_text())['child_finetune_run']}"
    return f"runs:/{latest_run('finetune')}"


def run(shape: str = "kimi", target: str | None = None, data: str | None = None, concurrency: str = "1,8",
        max_new_tokens: int = 48, max_prompts: int = 16, sweep_k: str | None = None) -> dict:
    os.environ.setdefault("DRAFTLINE_TINY_KIMI_DIR", str(Path("work/tiny-kimi").absolute()))
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{Path('mlflow.db').absolute()}")
    from draftline.config import EvaluateConfig
    from draftline.evaluation.stage import run as evaluate

    target = target or _drafter(shape)
    data = data or f"runs:/{latest_run('prepare', 'evaluation')}/data"
    out = evaluate(EvaluateConfig(target=target, data=data, max_new_tokens=max_new_tokens, max_prompts=max_prompts,
                                  speed_concurrency=concurrency, sweep_k=sweep_k, backend="vllm"),
                   progress=False).to_json()  # as `draftline evaluate` prints it
    from mlflow import MlflowClient

    metrics = MlflowClient().get_run(out["run_id"]).data.metrics
    speed = {k.removeprefix("eval/speed/"): v for k, v in sorted(metrics.items()) if k.startswith("eval/speed/")}
    summary = {f"speed-up at {c}": f"x{v[0]:.2f} [{v[1]:.2f}, {v[2]:.2f}] (drafted "
                                   f"{speed[c + '/drafted_tokens_per_s']:.1f} vs plain "
                                   f"{speed[c + '/plain_tokens_per_s']:.1f} tokens/s)"
               for c, v in out["speedup"].items()}
    summary["acceptance"] = f"measured {out['measured_acceptance_length']} on {out['prompts']} prompts"
    sweep = {k.removeprefix("eval/sweep/"): v for k, v in sorted(metrics.items()) if k.startswith("eval/sweep/")}
    if sweep:
        summary["fastest k"] = (f"k={out['recommended_num_speculative_tokens']} of {sweep_k}: "
                                + ", ".join(f"{k} x{next(iter(v.values()))[0]:.2f}" for k, v in out["sweep"].items()))
    return {"summary": summary, "shape": shape, "target": target, "data": data, "max_new_tokens": max_new_tokens,
            "prompts": out["prompts"], "num_speculative_tokens": 3, "concurrency": concurrency,
            "measured_acceptance_length": out["measured_acceptance_length"], "speed": speed,
            "sweep": sweep or None, "recommended_num_speculative_tokens": out["recommended_num_speculative_tokens"],
            "recommended_from": out["recommended_from"],
            "method": "evaluate --speed-concurrency: both loopback servers up, waves of c requests alternating "
                      "between them, each wave started once both servers are idle (vLLM on a CPU keeps a core "
                      "busy for ~1 s after a request), ignore_eos so both decode max_new_tokens; speed-up = "
                      "drafted over plain tokens/s, paired bootstrap over waves (95%)",
            "note": "measured on this machine's CPUs, where the drafted server's extra forwards cost about as much "
                    "as the accepted tokens save; a GPU deployment gates on >= 1.05 (registry_policies/gpu)"}
