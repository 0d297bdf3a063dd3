"""What the benchmarks that build on a demo's runs share: the newest finished run of a stage (of a data set, for
prepare), and a finetune at the Kimi demo's recipe (``demo_kimi.sh``) with the flags that make its two sides
differ."""

from __future__ import annotations

import json
import subprocess
import sys

# demo_real.sh's training settings (its ranks, tokens per rank, lr, warm-up, draft vocabulary), for a drafter of
# SmolLM2 from random init
SMOLLM2_RECIPE = ("--draft-vocab-size", "8192", "--gpus", "2", "--tokens-per-batch", "1024", "--lr", "1e-3",
                  "--warmup-steps", "10")
KIMI_RECIPE = ("--draft-vocab-size", "256", "--gpus", "2", "--zero-stage", "2", "--tokens-per-batch", "512",
               "--lr", "3e-3", "--warmup-steps", "0")


def latest_run(step: str, name: str | None = None) -> str:
    """The newest finished run of ``step``; for prepare, of the data set ``name`` (``prepare --name``: its run's
    dataset input)."""
    from mlflow import MlflowClient

    client = MlflowClient()
    exps = [e.experiment_id for e in client.search_experiments()]
    filt = f"tags.`draftline.step` = '{step}' and attributes.status = 'FINISHED'"
    for r in client.search_runs(exps, filt, order_by=["attributes.start_time DESC"]):
        if name is None or name in {d.dataset.name for d in r.inputs.dataset_inputs}:
            return r.info.run_id
    raise SystemExit(f"no finished {step} run{f' of the data set {name}' if name else ''}: run the shape's demo "
                     "first")


def finetune_kimi(data: str, evalset: str, *, steps: int, seed: int, side: list[str],
                  recipe: tuple[str, ...] = KIMI_RECIPE) -> str:
    """``draftline finetune`` at the Kimi demo's recipe (or ``recipe``) on ``data``, validated on ``evalset``, with
    ``side``'s flags (what the benchmark varies); the run id."""
    cmd = [sys.executable, "-m", "draftline.cli", "finetune", "--data", data, "--eval-data", evalset, *side,
           *recipe, "--steps", str(steps), "--val-every", str(steps), "--seed", str(seed)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"finetune {' '.join(side)} on {data} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout)["run_id"]
