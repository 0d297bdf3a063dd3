"""fp8-shards: does storing the hidden states in fp8 (``prepare --hidden-storage fp8``: E4M3, a scale per token and
layer) keep what vLLM serves? The training data's shards are written again in fp8 by the writer prepare uses
(``data.shards.write_shard``), so both sides hold the same capture and differ only in storage; a drafter is
finetuned on each at equal steps, seed and recipe, and each is evaluated by vLLM beside its verifier on the same
held-out prompts: served acceptance with its interval, the paired difference fp8 minus bf16 prompt by prompt,
and the shards' bytes.

``--shape kimi`` (after ``./demo_kimi.sh``): its vLLM-captured GSM8K data, the demo's recipe (from the tiny MLA
parent, ``--vocab rebuild``, 256 draft tokens). ``--shape smollm2`` (after ``./demo_real.sh``, its tracking store
in ``$MLFLOW_TRACKING_URI``): the team's GSM8K traffic and the child's recipe (from the demo's general parent,
``--vocab rebuild``), validated and evaluated on its GSM8K test set.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.demo_runs import finetune_kimi, latest_run
from draftline import names

ROOT = Path(__file__).resolve().parents[1]
STORAGES = ("bf16", "fp8")
RECIPES = {"kimi": "the Kimi demo's recipe (tiny MLA parent, --vocab rebuild, 256 draft tokens, lr 3e-3, ZeRO-2 on "
                   "2 CPU ranks), evaluated in bf16",
           "smollm2": "demo_real.sh's child recipe (its general parent, --vocab rebuild, lr 1e-3, 1024 tokens per "
                      "rank, 2 CPU ranks), evaluated in float32"}


def _as_fp8(src: Path, dest: Path) -> Path:
    """The prepared data at ``src`` with every shard written again in fp8 (same samples, same capture)."""
    import shutil

    from draftline.data.shards import FREQS, open_prepared, write_manifest, write_shard
    from draftline.data.storage import token_bytes

    data = open_prepared(src)
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / FREQS, dest / FREQS)
    records = data.records()
    entries, i = [], 0
    for entry in data.manifest["shards"]:
        part = records[i:i + entry["samples"]]
        i += entry["samples"]
        entries.append(write_shard(dest / entry["file"], part, "fp8"))
    per = token_bytes(data.manifest["hidden_size"], len(data.manifest["aux_layer_ids"]), "fp8")
    manifest = {**data.manifest, "shards": entries, "hidden_storage": "fp8", "location": str(dest.resolve()),
                "bytes_per_token": per}
    manifest.pop("digest", None)
    write_manifest(dest, manifest)
    return dest


def _bytes(d: Path) -> int:
    """The shards' bytes where they lie (a downloaded data set's manifest names their location)."""
    from draftline.data.shards import open_prepared

    data = open_prepared(d)
    return sum(((data.shard_root or d) / e["file"]).stat().st_size for e in data.manifest["shards"])


def _finetune_smollm2(data: str, evalset: str, *, steps: int, seed: int) -> str:
    """A finetune at demo_real.sh's child recipe on ``data``: from its general parent, ``--vocab rebuild``."""
    summary = ROOT / "work" / "real" / "summary.json"
    if not summary.is_file():
        raise SystemExit("no work/real/summary.json: run ./demo_real.sh first")
    parent = json.loads(summary.read_text())["parent"]["path"]
    cmd = [sys.executable, "-m", "draftline.cli", "finetune", "--data", data, "--eval-data", evalset, "--init", parent,
           "--vocab", "rebuild", "--gpus", "2", "--tokens-per-batch", "1024", "--lr", "1e-3", "--warmup-steps", "10",
           "--steps", str(steps), "--val-every", str(steps), "--seed", str(seed)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"finetune on {data} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout)["run_id"]


def run(shape: str = "kimi", steps: int = 100, seed: int = 0, max_new_tokens: int = 24) -> dict:
    os.environ.setdefault("DRAFTLINE_TINY_KIMI_DIR", str(ROOT / "work" / "tiny-kimi"))
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{ROOT / 'mlflow.db'}")
    from mlflow import MlflowClient

    from draftline.config import EvaluateConfig
    from draftline.data.refs import resolve_data
    from draftline.evaluation.stage import run as evaluate
    from draftline.registry.confidence import paired_difference, read_per_prompt

    client = MlflowClient()
    train_name = "team-gsm8k" if shape == "smollm2" else "conversations"
    train_ref, evalset = (f"runs:/{latest_run('prepare', name)}/data" for name in (train_name, "evaluation"))
    bf16_dir = resolve_data(train_ref)
    dirs = {"bf16": bf16_dir, "fp8": _as_fp8(bf16_dir, ROOT / "work" / "fp8-shards" / bf16_dir.name)}
    sides: dict[str, dict] = {}
    for storage in STORAGES:
        if shape == "smollm2":
            run_id = _finetune_smollm2(str(dirs[storage]), evalset, steps=steps, seed=seed)
        else:
            run_id = finetune_kimi(str(dirs[storage]), evalset, steps=steps, seed=seed,
                                   side=["--init", "tiny-kimi-mla", "--vocab", "rebuild"])
        out = evaluate(EvaluateConfig(target=f"runs:/{run_id}", data=evalset, max_new_tokens=max_new_tokens,
                                      speed_concurrency="off", backend="vllm"), progress=False).to_json()
        m = client.get_run(out["run_id"]).data.metrics
        sides[storage] = {"finetune_run": run_id, "evaluation_run": out["run_id"], "shard_bytes": _bytes(dirs[storage]),
                          "served": out["measured_acceptance_length"],
                          "served_low": m.get(names.MEASURED_LOW),
                          "served_high": m.get(names.MEASURED_HIGH), "prompts": out["prompts"],
                          "val_acceptance_length": client.get_run(run_id).data.metrics.get(names.VAL_ACCEPTANCE_LENGTH)}
    d = paired_difference(read_per_prompt(client, sides["fp8"]["evaluation_run"]) or [],
                          read_per_prompt(client, sides["bf16"]["evaluation_run"]) or [])
    summary = {s: f"served {v['served']:.3f} [{v['served_low']:.3f}, {v['served_high']:.3f}] on {v['prompts']} "
                  f"prompts; shards {v['shard_bytes']:,} bytes" for s, v in sides.items()}
    summary["fp8 / bf16 bytes"] = f"{sides['fp8']['shard_bytes'] / sides['bf16']['shard_bytes']:.3f}"
    if d is not None:
        summary["fp8 - bf16, paired by prompt"] = f"{d.value:+.3f} [{d.low:+.3f}, {d.high:+.3f}]"
    recipe = RECIPES[shape]
    return {"summary": summary, "shape": shape, "sides": sides, "steps": steps, "seed": seed, "data": train_ref,
            "evaluation_set": evalset, "max_new_tokens": max_new_tokens,
            "paired_fp8_minus_bf16": None if d is None else {"value": d.value, "low": d.low, "high": d.high,
                                                             "prompts": d.n},
            "method": "the demo's vLLM-captured bf16 shards written again in fp8 by prepare's shard writer; "
                      f"{recipe} on each, same seed; evaluate on vLLM on the same held-out prompts, k=3; "
                      "intervals: bootstrap over prompts (95%), paired by prompt for the difference"}
