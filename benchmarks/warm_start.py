"""warm-start: does a parent pay? We count the steps a finetune from the parent and one from random init need
to reach the validation accuracy random init reaches at the end, with the same data, batches and settings.

- ``tiny``: the parent (make-tiny trains it on the first half of the demo conversations) and a random init,
  finetuned side by side on the second half in this process (bare AdamW, fp32);
- ``smollm2``: a finished ``./demo_real.sh`` run. Its child (finetuned from the general parent on the GSM8K
  traffic, validated on the held-out evaluation set) is one side; the other is ``draftline finetune --init
  random`` with every setting of the child's run (data, evaluation set, draft vocabulary size, steps, tokens,
  lr, warm-up, precision, ranks, seed) read back from MLflow, so it is the pipeline's own DeepSpeed run on both
  sides. The random-init run is kept (tagged) and reused when the benchmark is run again.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from draftline import names

ROOT = Path(__file__).resolve().parents[1]
# the child's recipe, as its run logged it, handed to both counterparts (runs from before a param was logged
# take finetune's default for it)
RECIPE_FLAGS = ((names.TRAIN_LR_SCHEDULE, "--lr-schedule"), (names.TRAIN_TTT_LOSS_DECAY, "--ttt-loss-decay"),
                (names.TRAIN_HIDDEN_NOISE, "--hidden-noise"))


def run(shape: str = "tiny", **kw) -> dict:
    return run_real(**kw) if shape == "smollm2" else run_tiny(**kw)


def _reach(curve: list[tuple[int, float]], goal: float) -> int | None:
    return next((s for s, v in curve if v >= goal - 1e-9), None)


def run_real(summary: str | None = None, metrics=("full_acc_0", "acceptance_length"), steps: int | None = None,
             every: int | None = None) -> dict:
    """Read a finished real-tier run (``work/real/summary.json``), train its random-init counterpart once,
    compare the two validation curves. With ``steps`` other than the child's, both sides are trained here at
    that budget (from the child's parent, and from random init), every other setting the child's."""
    import json
    import os
    import subprocess
    import sys

    from mlflow import MlflowClient

    path = Path(summary) if summary else ROOT / "work" / "real" / "summary.json"
    if not path.is_file():
        raise SystemExit(f"no {path}: run ./demo_real.sh first (the real tier's warm start compares its child)")
    done = json.loads(path.read_text())
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{ROOT / 'mlflow.db'}")
    client = MlflowClient()
    child = client.get_run(done["child_finetune_run"])
    p = child.data.params
    ev = client.search_runs([child.info.experiment_id], f"tags.`draftline.data.digest` = '{p['eval.data.digest']}'"
                            " and tags.`draftline.step` = 'prepare'", max_results=1)
    if not ev:
        raise SystemExit(f"the evaluation set {p['eval.data.digest'][:12]} of run {child.info.run_id} is not here")
    history = {m: client.get_metric_history(child.info.run_id, f"val/{m}") for m in metrics}
    val_steps = sorted({h.step for h in history[metrics[0]]})
    val_every = val_steps[1] - val_steps[0] if len(val_steps) > 1 else int(p[names.TRAIN_STEPS])
    total = int(steps or p[names.TRAIN_STEPS])
    if steps and total != int(p[names.TRAIN_STEPS]):  # both sides trained here, at this budget
        val_every = every or max(1, total // 6)

    def counterpart(init: str, side: str):
        """The run with the child's settings from ``init`` (reused when the benchmark ran before)."""
        key = f"{child.info.run_id}/{side}/{total}"
        older = [child.info.run_id] if side == "random" and total == int(p[names.TRAIN_STEPS]) else []  # tagged so before
        for tag in (key, *older):
            mine = client.search_runs([child.info.experiment_id], f"tags.`draftline.bench.warm_start_of` = '{tag}'"
                                      " and attributes.status = 'FINISHED'", max_results=1)
            if mine:
                return mine[0]
        cmd = [sys.executable, "-m", "draftline.cli", "finetune", "--data", p[names.DATA_URI], "--init", init,
               "--draft-vocab-size", p[names.VOCAB_DRAFT_SIZE], "--eval-data", f"runs:/{ev[0].info.run_id}/data",
               "--gpus", p["world_size"], "--zero-stage", p[names.ZERO_STAGE], "--steps", str(total),
               "--tokens-per-batch", p[names.TRAIN_TOKENS_PER_BATCH], "--precision", p[names.TRAIN_PRECISION],
               "--lr", p[names.OPTIMIZER_LR], "--warmup-steps", p[names.OPTIMIZER_WARMUP_STEPS], "--val-every",
               str(val_every), "--seed", p[names.TRAIN_SEED], "--ttt-steps", p["ttt_steps"],
               *(["--vocab", p[names.VOCAB_POLICY]] if init != "random" else []),
               *[a for k, flag in RECIPE_FLAGS if k in p for a in (flag, p[k])]]
        print(f"  training the {side} side:", " ".join(cmd[3:]), flush=True)
        out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True, cwd=ROOT).stdout
        run_id = json.loads(out)["run_id"]
        client.set_tag(run_id, "draftline.bench.warm_start_of", key)
        return client.get_run(run_id)

    random_run = counterpart("random", "random")
    if total != int(p[names.TRAIN_STEPS]):
        child = counterpart(p["init"], "parent")
    curves = {name: {m: [(h.step, h.value) for h in sorted(client.get_metric_history(r.info.run_id, f"val/{m}"),
                                                             key=lambda h: h.step)] for m in metrics}
              for name, r in (("random", random_run), ("parent", child))}
    result = {"shape": "smollm2", "verifier": p[names.VERIFIER_NAME_OR_PATH], "steps": total,
              "val_every": val_every, "runs": {"parent": child.info.run_id, "random": random_run.info.run_id},
              "settings": {k: p[k] for k in (names.DATA_URI, names.VOCAB_DRAFT_SIZE, "world_size", names.TRAIN_TOKENS_PER_BATCH,
                                             names.TRAIN_PRECISION, names.OPTIMIZER_LR, names.OPTIMIZER_WARMUP_STEPS)},
              "parent": child.data.tags.get("draftline.parent.name") or p.get(names.PARENT_NAME),
              "curves": curves, "targets": {"ratio": 0.2}, "summary": {}}
    for m in metrics:
        goal = curves["random"][m][-1][1]
        reach = {n: _reach(c[m], goal) for n, c in curves.items()}
        ratio = reach["parent"] / reach["random"] if reach["parent"] is not None and reach["random"] else None
        result[f"val/{m}"] = {"goal (random at the end)": goal, "steps_to_goal": reach, "ratio": ratio,
                              "at_step_0": {n: c[m][0][1] for n, c in curves.items()},
                              "at_end": {n: c[m][-1][1] for n, c in curves.items()}}
        result["summary"][f"val/{m}"] = (
            f"random ends at {goal:.3f}; parent reaches it at step {reach['parent']} of {reach['random']} "
            f"({'n/a' if ratio is None else f'{ratio:.2f}x'}; goal <= 0.2x); parent starts at "
            f"{curves['parent'][m][0][1]:.3f}, ends at {curves['parent'][m][-1][1]:.3f}")
    return result


def run_tiny(steps: int = 150, every: int = 10, metric: str = "full_acc_0", parent_steps: int = 600) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftline.data.capture import capture_hidden_states
    from draftline.data.conversations import load_conversations
    from draftline.data.tokenize import tokenize_conversations
    from draftline.drafter.checkpoints import find_checkpoint, load_into_model, read_tensors
    from draftline.drafter.model import (
        accumulate,
        build_draft_model,
        forward,
        loss_config,
        pack,
        summarise,
        train_steps_in_process,
    )
    from draftline.testing.tiny import make_tiny
    from draftline.train.worker import split_validation

    demo = ROOT / "configs" / "demo" / "conversations.jsonl"
    with tempfile.TemporaryDirectory(prefix="draftline-warm-") as tmp:
        # a parent trained 4x longer than the finetune (real parents are trained far longer than a finetune)
        tiny = make_tiny(Path(tmp), demo, parent_steps=parent_steps, progress=False)
        tok = AutoTokenizer.from_pretrained(tiny["verifier"])
        verifier = AutoModelForCausalLM.from_pretrained(tiny["verifier"]).eval()
        samples = tokenize_conversations(load_conversations(demo).samples, tok, 512)
        second_half = samples[len(samples) // 2:]  # the parent never saw these
        records = [{k: (v.float() if v.is_floating_point() else v) for k, v in r.items()}
                   for r in capture_hidden_states(verifier, second_half, [2, 4, 5])]
        train, val = split_validation(records, 0.2)
        vocab = read_tensors(find_checkpoint(tiny["parent"]), {"d2t", "t2d"})
        cfg = loss_config()

        def evaluate(model) -> dict[str, float]:
            model.eval()
            with torch.no_grad():
                sums = {}
                for i in range(0, len(val), 8):
                    accumulate(sums, forward(model, pack(val[i:i + 8]), 3, cfg)[1])
            model.train()
            return summarise(sums, 3)

        curves = {}
        for name in ("random", "parent"):
            torch.manual_seed(0)
            model = build_draft_model(str(tiny["verifier"]), d2t=vocab["d2t"], t2d=vocab["t2d"],
                                      aux_layer_ids=[2, 4, 5], draft_vocab_size=int(vocab["d2t"].numel()),
                                      dtype=torch.float32)
            if name == "parent":
                load_into_model(model, find_checkpoint(tiny["parent"]))
            curve = [(0, evaluate(model)[metric])]
            # same batches in the same order for both (the order depends on the seed only)
            train_steps_in_process(model, train, steps=steps, lr=1e-3, tokens_per_batch=512, seed=0,
                                   callback=lambda s, m=model, c=curve: c.append((s, evaluate(m)[metric])),
                                   callback_every=every)
            curves[name] = curve
    goal = curves["random"][-1][1]
    reach = {n: next((s for s, v in c if v >= goal), None) for n, c in curves.items()}
    ratio = (reach["parent"] / reach["random"]) if reach["parent"] is not None and reach["random"] else None
    return {"shape": "tiny", "metric": f"val/{metric}", "steps": steps, "parent_steps": parent_steps,
            "curves": curves,
            "goal (random at the end)": goal, "steps_to_goal": reach, "targets": {"ratio": 0.2},
            "summary": {f"val/{metric} random at end": f"{goal:.3f}",
                        "steps to reach it: random": str(reach["random"]),
                        "steps to reach it: from parent": str(reach["parent"]),
                        "ratio (parent/random)": f"{ratio:.2f} (target <= 0.2)" if ratio is not None else "n/a"}}
