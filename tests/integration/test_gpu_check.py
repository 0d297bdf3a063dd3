"""The prepared GPU check, CPU-sized (``--shape tiny``), so it does not rot between GPU runs: the same script and
parts as on the H200 (train step bare vs ZeRO-2/3, sdpa vs flex vs blockwise attention, the step profile, a
finetune through export and the speculators reload), on the CPU with gloo ranks; flex attention is skipped, saying why."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_tiny_runs_every_part(tmp_path):
    out = tmp_path / "gpu-check.json"
    env = {**os.environ, "PYTHON": sys.executable, "DRAFTLINE_GPU_CHECK_STANDINS": "1",  # speculators without datasets
           "DRAFTLINE_GPU_CHECK_WHEELS": str(tmp_path / "no-wheels")}
    t = time.monotonic()
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--shape", "tiny", "--out", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    took = time.monotonic() - t
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    parts = result["parts"]
    assert result["standins"] == ["datasets"]
    assert set(parts) == {"train_step", "attention", "step_profile", "finetune"}, proc.stdout
    for name, part in parts.items():
        assert "error" not in part and "skipped" not in part, f"{name}: {part}"

    variants = parts["train_step"]["variants"]
    assert set(variants) == {"bare", "zero2", "zero3"}
    assert all(v["tokens_per_s"] > 0 and v["tflops"] > 0 for v in variants.values())
    assert all(variants[s]["plan_gib"] > 0 for s in ("zero2", "zero3"))

    impls = parts["attention"]["impls"]
    assert impls["sdpa"]["tokens_per_s"] > 0 and impls["blockwise"]["tokens_per_s"] > 0
    flex = impls["simple_flex_attention"]
    assert ("skipped" in flex and "CUDA" in flex["skipped"]) if not result["machine"]["cuda"] else "step_s_median" in flex

    profile = parts["step_profile"]["by_variant"]
    assert set(profile) == {"before", "onepass-loss", "blockwise"}
    assert all(v["tokens_per_s"] > 0 and sum(v["share"].values()) > 0.99 for v in profile.values())

    ft = parts["finetune"]
    assert ft["export_validated"] == "true" and ft["model_uri"] == "models:/gpu-check/1"
    assert not ft["optimizer_state_logged"]
    assert ft["artifact_bytes_over_weights"] < 1.1  # tiny weights: the metadata files weigh relatively more
    print(f"gpu_check --shape tiny: {took:.0f} s; parts: " + ", ".join(f"{k} {v['wall_s']} s" for k, v in parts.items()))
