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
    flops = parts["train_step"]["model_flops_per_step"]
    for v in variants.values():  # the rate and the FLOP/s are the same median step, read two ways
        assert v["tflops"] == pytest.approx(flops / v["step_s_median"] / 1e12)
        assert 0 < v["tflops"] < 50  # a CPU, not a GPU
        assert v["mfu"] is None  # no peak to read it against off a GPU
    tokens = {round(v["tokens_per_s"] * v["step_s_median"]) for v in variants.values()}
    assert len(tokens) == 1  # every variant timed at the same tokens a step
    assert 0 < variants["zero3"]["plan_gib"] < variants["zero2"]["plan_gib"]  # ZeRO-3 partitions what ZeRO-2 keeps

    impls = parts["attention"]["impls"]
    for impl in ("sdpa", "blockwise"):
        i = impls[impl]
        assert min(i["step_s_all"]) <= i["step_s_median"] <= max(i["step_s_all"])
    assert impls["sdpa"]["tokens_per_s"] * impls["sdpa"]["step_s_median"] == pytest.approx(
        impls["blockwise"]["tokens_per_s"] * impls["blockwise"]["step_s_median"])  # the same batch on both
    flex = impls["simple_flex_attention"]
    assert ("skipped" in flex and "CUDA" in flex["skipped"]) if not result["machine"]["cuda"] else "step_s_median" in flex

    profile = parts["step_profile"]["by_variant"]
    assert set(profile) == {"before", "onepass-loss", "blockwise"}
    assert all(sum(v["share"].values()) == pytest.approx(1.0, abs=0.01) for v in profile.values())
    assert all(0 <= x <= 1 for v in profile.values() for x in v["share"].values())

    ft = parts["finetune"]
    assert ft["export_validated"] == "true" and ft["model_uri"] == "models:/gpu-check/1"
    assert not ft["optimizer_state_logged"]
    assert ft["artifact_bytes_over_weights"] < 1.1  # tiny weights: the metadata files weigh relatively more
    print(f"gpu_check --shape tiny: {took:.0f} s; parts: " + ", ".join(f"{k} {v['wall_s']} s" for k, v in parts.items()))
