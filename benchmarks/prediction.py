"""prediction: what the drafter's own teacher-forced forward says vLLM will serve, beside what vLLM served.

Reads a finished real-tier run (``work/real/summary.json`` and its four evaluate runs: parent and child, on
held-out GSM8K test prompts and held-out MT-Bench categories). For each it recomputes, from the run's drafter
and evaluation set, in one process:

- ``uniform``: teacher-forced acceptance, ``1 + sum_k prod cond_acc_k``, averaged over every reply position
  of the whole set (what ``val/acceptance_length`` and the scaling curve report);
- ``walk_full``: vLLM's walk over the same drafts (``walk_acceptance_length``), the whole set;
- ``walk_served``: the walk over the very replies the evaluation served (its first prompts, the first
  ``max_new_tokens`` tokens of each), which is ``eval/predicted/acceptance_length``;

and reads ``served``: vLLM's own figure, with its per-position rates, from the evaluate run.
"""

from __future__ import annotations

import json
from pathlib import Path

from draftline import names

ROOT = Path(__file__).resolve().parents[1]


def _one(client, run_id: str) -> dict:
    from draftline.config import EvaluateConfig, work_dir
    from draftline.data.refs import resolve_data
    from draftline.data.shards import open_prepared
    from draftline.evaluation.stage import _verifier
    from draftline.evaluation.targets import load_drafter, resolve_target
    from draftline.evaluation.teacher_forced import measure, served_samples
    from draftline.tracking import experiment_id

    run = client.get_run(run_id)
    p, m = run.data.params, run.data.metrics
    k, prompts, new = int(p["num_speculative_tokens"]), int(p["prompts"]), int(p["max_new_tokens"])
    cfg = EvaluateConfig(target=p["target"], data=p[names.DATA_URI])
    data = open_prepared(resolve_data(cfg.data), verify=True)
    checkpoint = p.get("checkpoint", "none")  # "none": the target is not a finetune run
    target = resolve_target(cfg.target, cache=work_dir() / "cache", experiment_id=experiment_id(),
                            checkpoint="best" if checkpoint == "none" else checkpoint)
    drafter = load_drafter(target, _verifier(cfg, data.manifest), data.manifest["aux_layer_ids"], ttt_steps=k)
    records = data.records()
    whole = measure(drafter, records, ttt_steps=k)
    served = measure(drafter, [s for _, s in served_samples(records, prompts, new)], ttt_steps=k)
    return {
        "target": p["target"], "data": p[names.DATA_NAME], "samples": len(records), "served_prompts": prompts,
        "max_new_tokens": new, "evaluate_run": run_id,
        "uniform": round(whole["acceptance_length"], 4),
        "walk_full": round(whole["walk_acceptance_length"], 4),
        "walk_served": round(served["walk_acceptance_length"], 4),
        "walk_served_per_position": [round(served[f"walk_pos_{i}"], 4) for i in range(k)],
        "served": round(m[names.MEASURED_ACCEPTANCE_LENGTH], 4),
        "served_per_position": [round(m[f"eval/measured/acceptance_rate_pos_{i + 1}"], 4) for i in range(k)],
        "served_backend": p["backend"],
        "served_minus_walk_served": round(m[names.MEASURED_ACCEPTANCE_LENGTH] - served["walk_acceptance_length"], 4),
        "served_minus_uniform": round(m[names.MEASURED_ACCEPTANCE_LENGTH] - whole["acceptance_length"], 4),
    }


def run(work: str | None = None) -> dict:
    import mlflow
    import torch

    from draftline import tracking

    torch.set_num_threads(1)
    root = Path(work) if work else ROOT / "work" / "real"
    summary = json.loads((root / "summary.json").read_text())
    tracking.setup()
    client = mlflow.MlflowClient()
    rows = {}
    for name in ("parent-gsm8k", "child-gsm8k", "parent-mtbench", "child-mtbench"):
        rows[name] = _one(client, json.loads((root / f"eval-{name}.json").read_text())["run_id"])
        print(f"  {name:<15} uniform {rows[name]['uniform']:.3f}  walk (whole set) {rows[name]['walk_full']:.3f}  "
              f"walk (served replies) {rows[name]['walk_served']:.3f}  served {rows[name]['served']:.3f}", flush=True)
    gaps = [abs(r["served_minus_walk_served"]) for r in rows.values()]
    return {"shape": "smollm2", "scale": summary.get("scale"), "model": summary.get("model"),
            "variants": {}, "rows": rows,
            "summary": {"largest |served - walk over the served replies|": round(max(gaps), 4),
                        "largest |served - uniform teacher-forced|": round(
                            max(abs(r["served_minus_uniform"]) for r in rows.values()), 4)}}
