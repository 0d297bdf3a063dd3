"""layers-served: which decoder layer to give a Kimi drafter, judged by what vLLM serves. After ``./demo_kimi.sh``
(its vLLM-answered, vLLM-captured training data and held-out evaluation set in ``mlflow.db``), two drafters are
finetuned from random init at equal data, steps, seed, draft vocabulary and recipe, one with a Llama decoder
layer and one with DeepSeek-V3's MLA layer (``--drafter-layer``); each is then evaluated by vLLM beside the
Kimi-shaped verifier on the same prompts: served acceptance with its interval, the paired difference MLA minus
Llama prompt by prompt, tokens/s with and without the drafter, trained parameters and the training step's
tokens/s.

vLLM serves an MLA drafter beside an MLA verifier on every CPU; a Llama-layer drafter only where the CPU has Intel
AMX (its attention's KV blocks must match the MLA verifier's). Where it cannot, that side records why and the
MLA side is measured alone.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from benchmarks.demo_runs import KIMI_RECIPE, SMOLLM2_RECIPE, finetune_kimi, latest_run
from draftline import names

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("llama", "mla")


def evaluate_served(target: str, evalset: str, max_new_tokens: int, concurrency: str, **settings) -> dict:
    """``draftline evaluate`` of ``target`` on vLLM, as it prints it; ``{"not_served": why}`` where vLLM cannot
    serve it here."""
    from draftline.config import EvaluateConfig
    from draftline.errors import DraftlineError
    from draftline.evaluation.stage import run as evaluate

    try:
        return evaluate(EvaluateConfig(target=target, data=evalset, max_new_tokens=max_new_tokens,
                                       speed_concurrency=concurrency, backend="vllm", **settings),
                        progress=False).to_json()
    except DraftlineError as e:  # a Llama-layer drafter beside an MLA verifier on a CPU without AMX
        return {"not_served": str(e)}


def served_figures(client, evaluated: dict) -> dict:
    """What vLLM served in an evaluation (:func:`evaluate_served`'s answer): acceptance with its interval, the
    prompts, the speed-ups."""
    if "not_served" in evaluated:
        raise SystemExit(f"vLLM did not serve it: {evaluated['not_served']}")
    metrics = client.get_run(evaluated["run_id"]).data.metrics
    return {"evaluation_run": evaluated["run_id"], "served": evaluated["measured_acceptance_length"],
            "served_low": metrics.get(names.MEASURED_LOW), "served_high": metrics.get(names.MEASURED_HIGH),
            "prompts": evaluated["prompts"], "speedup": dict(evaluated.get("speedup", {}))}


def paired_by_prompt(client, a: dict, b: dict) -> dict | None:
    """Side ``a`` minus side ``b`` (each with its ``evaluation_run``), prompt by prompt; None without per-prompt
    evidence on both."""
    from draftline.registry.confidence import paired_difference, read_per_prompt

    mine, theirs = (read_per_prompt(client, s["evaluation_run"]) for s in (a, b))
    d = paired_difference(mine, theirs) if mine and theirs else None
    return None if d is None else {"value": d.value, "low": d.low, "high": d.high, "prompts": d.n}


def summarize(sides: dict[str, dict], paired: dict | None, label: str = "mla - llama") -> dict[str, str]:
    """The headline lines of a result (``python -m benchmarks.layers_served FILE`` writes them again)."""
    summary = {}
    for name, s in sides.items():
        if "not_served" in s:
            summary[f"{name} served"] = f"not served here: {s['not_served'][:160]}"
            continue
        speed = ", ".join(f"{c} x{v[0]:.2f} [{v[1]:.2f}, {v[2]:.2f}]" for c, v in s["speedup"].items())
        summary[f"{name} served"] = (f"{s['served']:.3f} [{s['served_low']:.3f}, {s['served_high']:.3f}] on "
                                     f"{s['prompts']} prompts; speed-up {speed}; trained params "
                                     f"{s['trained_params']:,}; training {s['train_tokens_per_s']:.0f} tokens/s")
    if paired:
        summary[f"{label}, paired by prompt"] = f"{paired['value']:+.3f} [{paired['low']:+.3f}, {paired['high']:+.3f}]"
    return summary


def compare(sides: dict[str, list[str]], *, steps: int, seed: int, max_new_tokens: int,
            concurrency: str, shape: str = "kimi") -> tuple[dict[str, dict], dict | None, str, str]:
    """Finetune one drafter per side (its flags) from the Kimi demo's data (``shape`` smollm2: demo_real.sh's team
    data, at its training settings) at equal steps and seed, evaluate each by vLLM on the same held-out prompts;
    ``(sides, paired: the second minus the first, by prompt, data, evaluation set)``."""
    os.environ.setdefault("DRAFTLINE_TINY_KIMI_DIR", str(ROOT / "work" / "tiny-kimi"))
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{ROOT / 'mlflow.db'}")
    from mlflow import MlflowClient

    client = MlflowClient()
    train_name = "team-gsm8k" if shape == "smollm2" else "conversations"
    data, evalset = (f"runs:/{latest_run('prepare', name)}/data" for name in (train_name, "evaluation"))
    recipe = SMOLLM2_RECIPE if shape == "smollm2" else KIMI_RECIPE
    out: dict[str, dict] = {}
    for name, flags in sides.items():
        run_id = finetune_kimi(data, evalset, steps=steps, seed=seed, side=flags, recipe=recipe)
        train = client.get_run(run_id).data
        evaluated = evaluate_served(f"runs:/{run_id}", evalset, max_new_tokens, concurrency)
        plan = client.download_artifacts(run_id, "plan.json", tempfile.mkdtemp())
        side = {"finetune_run": run_id, "flags": flags,
                "trained_params": json.loads(Path(plan).read_text())["trainable"],
                "train_tokens_per_s": train.metrics.get(names.TRAIN_TOKENS_PER_S),
                "val_acceptance_length": train.metrics.get(names.VAL_ACCEPTANCE_LENGTH)}
        if "not_served" in evaluated:
            side["not_served"] = evaluated["not_served"]
        else:
            side.update(served_figures(client, evaluated))
        out[name] = side
    first, second = out.values()
    served = all("evaluation_run" in s for s in out.values())
    return out, paired_by_prompt(client, second, first) if served else None, data, evalset


def cpu_has_amx() -> bool | None:
    return "amx" in Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else None


def run(steps: int = 100, seed: int = 0, max_new_tokens: int = 24, concurrency: str = "1") -> dict:
    sides, paired, data, evalset = compare({layer: ["--init", "random", "--drafter-layer", layer]
                                            for layer in LAYERS}, steps=steps, seed=seed,
                                           max_new_tokens=max_new_tokens, concurrency=concurrency)
    return {"summary": summarize(sides, paired), "shape": "kimi", "sides": sides, "paired_mla_minus_llama": paired,
            "steps": steps, "seed": seed, "data": data, "evaluation_set": evalset, "max_new_tokens": max_new_tokens,
            "concurrency": concurrency, "amx": cpu_has_amx(),
            "method": "from random init, the same vLLM-answered data, steps, seed, draft vocabulary 256, lr 3e-3, "
                      "ZeRO-2 on 2 CPU ranks; evaluate on vLLM (bf16) on the same held-out prompts, k=3; "
                      "intervals: bootstrap over prompts (95%), paired by prompt for the difference"}


if __name__ == "__main__":  # rewrite a result's summary from its figures
    path = Path(sys.argv[1])
    result = json.loads(path.read_text())
    result["summary"] = summarize(result["sides"], result["paired_mla_minus_llama"])
    path.write_text(json.dumps(result, indent=2) + "\n")
