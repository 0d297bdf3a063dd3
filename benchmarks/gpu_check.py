"""The prepared GPU check (``benchmarks/gpu_check.sh`` installs the carried wheels, then runs this).

    python -m benchmarks.gpu_check [--shape real|tiny] [--out FILE] [--parts train_step,attention,step_profile,finetune]

Four parts, each in its own process (a crash or an out-of-memory in one does not lose the others), each with
its share of the time budget; the JSON is rewritten after every part, so a timeout keeps what finished:

* ``train_step``: the Kimi-K2 drafter's step (hidden 7168, draft vocabulary 32000, target vocabulary 163840),
  bare PyTorch AdamW vs ZeRO-2 and ZeRO-3 on one rank (``benchmarks.train_step``, interleaved rounds): tokens/s,
  MFU against 790 TFLOP/s (bf16 dense, H200), each variant's peak memory vs what ``draftline plan`` predicts.
* ``attention``: forward + backward of the same drafter with ``sdpa`` vs ``simple_flex_attention`` (what
  speculators picks when no implementation is set) vs ``blockwise`` (finetune's choice on CPU ranks) at the same
  tokens per rank; flex needs CUDA.
* ``step_profile``: ``benchmarks.step_profile`` on the device: the step before the CPU work (speculators' eager
  KL) vs the one-pass loss vs blockwise attention, interleaved rounds, kernel-time shares per kind of operator,
  and MFU against 790 TFLOP/s.
* ``finetune``: ``draftline finetune`` for 10 steps from a random AQ-MedAI-layout parent on synthetic
  hidden-state shards, then ``draftline export`` (which reloads the export through speculators and compares),
  on a sqlite tracking store inside the run's folder.

A part whose prerequisite is missing (no CUDA for flex attention, no MLflow for the finetune) records
``{"skipped": reason}``; one that fails records ``{"error": ...}``. ``--shape tiny`` is the same code on the
CPU (gloo), sized for the test suite.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from draftline import names

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "gpu-check.json"
PEAK_TFLOPS = 790.0  # H200, bf16 dense
PARTS = ("train_step", "attention", "step_profile", "finetune")
SIZES = {  # tokens per rank, timed iterations, finetune steps, synthetic samples x tokens
    "real": {"tokens": 4096, "iters": 5, "steps": 10, "samples": 10, "sample_tokens": 1024},
    "tiny": {"tokens": 128, "iters": 2, "steps": 3, "samples": 8, "sample_tokens": 96},
}
SHARE = {"train_step": 0.25, "attention": 0.1, "step_profile": 0.15, "finetune": 0.5}  # of the time budget


MARK = "GPU-CHECK-RESULT "
STANDINS = ROOT / "benchmarks" / "standins"


def standins() -> list[str]:
    """Stand-ins the parts get: ``datasets`` where it is not installed (speculators imports it for its own
    trainer only), or always with ``DRAFTLINE_GPU_CHECK_STANDINS=1`` (the test uses it)."""
    forced = os.environ.get("DRAFTLINE_GPU_CHECK_STANDINS") == "1"
    return ["datasets"] if forced or importlib.util.find_spec("datasets") is None else []


def run_group(parts: list[str], shape: str, tmp: Path, budget_s: float) -> dict[str, dict]:
    """Run ``parts`` in one child process within their share of the budget; a part that left no result line
    (killed, timed out, crashed) gets ``{"error": ...}`` with the end of the child's output."""
    limit = budget_s * sum(SHARE[p] for p in parts)
    paths = [*(str(STANDINS),) * bool(standins()), str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths).rstrip(os.pathsep)}
    t = time.perf_counter()
    cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--child", ",".join(parts), shape, str(tmp)]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit)
        stdout, tail, why = proc.stdout, proc.stderr[-3000:], f"exited {proc.returncode}"
    except subprocess.TimeoutExpired as e:
        text = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")  # noqa: E731
        stdout, tail, why = text(e.stdout), text(e.stderr)[-3000:], f"timed out after {limit:.0f} s"
    found = {}
    for line in stdout.splitlines():
        if line.startswith(MARK):
            name, _, payload = line[len(MARK):].partition(" ")
            found[name] = json.loads(payload)
    elapsed = round(time.perf_counter() - t, 1)
    return {p: found.get(p) or {"error": f"{why} before this part reported: {tail}", "wall_s": elapsed}
            for p in parts}


class Skip(Exception):
    """A part's prerequisite is missing: recorded as ``{"skipped": reason}``."""


def need(*modules: str) -> None:
    """Import ``modules`` or skip the part, saying which failed and why (not installed, or a dependency
    missing)."""
    missing = []
    for m in modules:
        try:
            importlib.import_module(m)
        except Exception as e:  # noqa: BLE001 (any import failure is a missing prerequisite)
            missing.append(f"{m} ({type(e).__name__}: {e})"[:300])
    if missing:
        raise Skip(f"cannot import {'; '.join(missing)}: run benchmarks/gpu_check.sh, which installs the wheels "
                   "carried in benchmarks/wheels/ (built with --build-wheels)")


def step_flops(s: dict, tokens: int, ttt: int = 3, docs: int = 4) -> float:
    """Model FLOPs of one training step (forward + backward), counted as useful work, not as kernels run.

    Per token and TTT step: the decoder layer's matmuls (6 x params: forward 2, backward 4), the frozen draft
    ``lm_head`` (4 x: forward and input gradient), attention over the keys a query sees (``docs`` samples of
    ``tokens / docs``, causal: ~L/2 keys, plus one per earlier TTT step; 12 x query width per key). Once per
    token: ``fc`` (6 x 3H x H) and the target logits (2 x V x H, no gradient)."""
    h, i, v = s["hidden_size"], s["intermediate_size"], s["draft_vocab_size"]
    q, kv = s["num_attention_heads"] * s["head_dim"], s["num_key_value_heads"] * s["head_dim"]
    layer = 2 * h * q + 2 * (2 * h * kv) + q * h + 3 * h * i
    length = tokens / docs
    per_token = sum(6 * layer + 4 * v * h + 12 * q * (length / 2 + j) for j in range(ttt))
    return tokens * (per_token + 6 * 3 * h * h + 2 * v * h)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def part_train_step(shape: str) -> dict:
    need("deepspeed", "speculators.models.eagle3")
    from benchmarks.common import SHAPES, drafter_config
    from benchmarks.train_step import run
    from draftline.train.plan import make_plan

    size = SIZES[shape]
    result = run(shape=shape, tokens=size["tokens"], iters=size["iters"], warmup=1, stages=(2, 3), rounds=3)
    flops = step_flops(SHAPES[shape], size["tokens"])
    plan = make_plan(drafter_config(shape), gpus=1, nodes=1, gpu_memory_gib=None,
                     tokens_per_batch=size["tokens"], ttt_steps=3, attn_impl="sdpa")
    for name, v in result["variants"].items():
        v["tflops"] = flops / v["step_s_median"] / 1e12
        v["mfu"] = v["tflops"] / PEAK_TFLOPS if result["device"].startswith("cuda") else None
        stage = None if name == "bare" else name[4:]
        if stage is not None:
            v["plan_gib"] = plan["stages"][stage]["total"] / 2**30
            if "peak_gpu_mem_gib" in v:
                v["peak_over_plan"] = v["peak_gpu_mem_gib"] / v["plan_gib"]
    result["model_flops_per_step"] = flops
    result["peak_tflops"] = PEAK_TFLOPS
    result["plan"] = {"gpus": 1, "source": "draftline plan (src/draftline/train/plan.py), bf16, sdpa, ttt 3",
                      "stages": {k: {"total_gib": st["total"] / 2**30, "activations_gib": st["activations"] / 2**30}
                                 for k, st in plan["stages"].items()}}
    return result


def part_attention(shape: str) -> dict:
    need("speculators.models.eagle3")
    import torch

    from benchmarks.common import SHAPES, bench_model, drafter_config, fake_batch
    from draftline.drafter.model import forward, loss_config
    from draftline.train.plan import make_plan

    cuda = _cuda()
    device = torch.device("cuda" if cuda else "cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    size, cfg = SIZES[shape], loss_config()
    impls = {"sdpa": None, "simple_flex_attention": None if cuda else "flex attention needs CUDA (no GPU here)",
             "blockwise": None}
    out: dict = {"shape": shape, "device": str(device), "tokens_per_rank": size["tokens"], "impls": {}}
    steps, peak = {}, {}
    for impl, skip in impls.items():
        if skip:
            out["impls"][impl] = {"skipped": skip}
            continue
        before = torch.cuda.memory_allocated() if cuda else 0
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        try:
            torch.manual_seed(0)
            model = bench_model(shape, device, attn=impl)
            batch = fake_batch(model, size["tokens"], device)

            def step(model=model, batch=batch):
                loss, _ = forward(model, batch, 3, cfg)
                loss.backward()
                model.zero_grad(set_to_none=True)
            t = time.perf_counter()
            step()  # the first call compiles flex attention's kernels
            sync()
            first = time.perf_counter() - t
        except Exception as e:  # noqa: BLE001 (one implementation failing is a finding, not the end)
            out["impls"][impl] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            continue
        steps[impl] = step
        peak[impl] = (torch.cuda.max_memory_allocated() - before) / 2**30 if cuda else None
        out["impls"][impl] = {"first_step_s": first}
    times = {k: [] for k in steps}
    for r in range(3):  # interleaved rounds, order rotated
        order = list(steps)[r % max(1, len(steps)):] + list(steps)[:r % max(1, len(steps))]
        for impl in order:
            for _ in range(size["iters"]):
                t = time.perf_counter()
                steps[impl]()
                sync()
                times[impl].append(time.perf_counter() - t)
    flops = step_flops(SHAPES[shape], size["tokens"])
    for impl, ts in times.items():
        med = statistics.median(ts)
        plan = make_plan(drafter_config(shape, impl), gpus=1, gpu_memory_gib=None, tokens_per_batch=size["tokens"],
                         ttt_steps=3, attn_impl=impl)
        out["impls"][impl].update({
            "step_s_median": med, "step_s_all": ts, "tokens_per_s": size["tokens"] / med,
            "mfu": flops / med / 1e12 / PEAK_TFLOPS if cuda else None,
            "peak_gpu_mem_gib": peak[impl], "plan_activations_gib": plan["activations"]["bytes"] / 2**30})
    if {"sdpa", "simple_flex_attention"} <= times.keys():
        out["flex_over_sdpa_time"] = out["impls"]["simple_flex_attention"]["step_s_median"] / \
            out["impls"]["sdpa"]["step_s_median"]
    out["what"] = "forward + backward (no optimiser) of the bf16 drafter, ttt 3, 4 samples packed"
    return out


def part_step_profile(shape: str) -> dict:
    need("speculators.models.eagle3")
    from benchmarks.common import SHAPES
    from benchmarks.step_profile import run

    cuda = _cuda()
    size = SIZES[shape]
    out = run(shape=shape, tokens=size["tokens"], rounds=3, micro=(), device="cuda" if cuda else "cpu",
              variants=("onepass-loss", "blockwise"))
    flops = step_flops(SHAPES[shape], size["tokens"])
    for v in out["by_variant"].values():
        v["mfu"] = flops / v["step_s_median"] / 1e12 / PEAK_TFLOPS if cuda else None
    out["model_flops_per_step"], out["peak_tflops"] = flops, PEAK_TFLOPS
    return out


def part_finetune(shape: str, work: Path) -> dict:
    need("deepspeed", "speculators.models.eagle3", "mlflow", "mlflow.models.utils")
    from benchmarks.gpu_inputs import make_inputs

    size = SIZES[shape]
    work.mkdir(parents=True, exist_ok=True)
    os.environ.update({"MLFLOW_TRACKING_URI": f"sqlite:///{work / 'mlflow.db'}", "DRAFTLINE_WORK": str(work / "work"),
                       "MLFLOW_EXPERIMENT_NAME": "gpu-check"})
    t = time.perf_counter()
    inputs = make_inputs(shape, work, samples=size["samples"], sample_tokens=size["sample_tokens"])
    made_s = time.perf_counter() - t

    from mlflow import MlflowClient

    from draftline.config import ExportConfig, FinetuneConfig
    from draftline.export import stage as export
    from draftline.train import finetune

    cfg = FinetuneConfig(data=str(inputs["data"]), init=str(inputs["parent"]), steps=size["steps"], zero_stage=2,
                         gpus=1 if _cuda() else 0, tokens_per_batch=size["tokens"], val_fraction=0.0,
                         save_every=size["steps"], warmup_steps=2,
                         parent_aux_convention="vllm")  # gpu_inputs writes it for data captured at its ids as vLLM counts
    t = time.perf_counter()
    ft = finetune.run(cfg)
    ft_s = time.perf_counter() - t
    t = time.perf_counter()
    ex = export.run(ExportConfig(run=ft.run_id, registered_model="gpu-check"))
    ex_s = time.perf_counter() - t
    client = MlflowClient()
    run = client.get_run(ft.run_id)

    def files(path=None):
        for f in client.list_artifacts(ft.run_id, path):
            yield from files(f.path) if f.is_dir else [(f.path, f.file_size or 0)]
    artifacts = dict(files())
    weights = artifacts.get("weights/model.safetensors", 0)
    metrics = run.data.metrics
    version = client.get_model_version("gpu-check", ex.version)
    return {
        "shape": shape, "steps": size["steps"], "tokens_per_batch": size["tokens"], "zero_stage": 2,
        "inputs_s": made_s, "finetune_s": ft_s, "export_s": ex_s, "inputs": inputs["sizes"],
        "train": {k: metrics[k] for k in (names.TRAIN_LOSS, names.TRAIN_TOKENS_PER_S, names.TRAIN_FULL_ACC_0) if k in metrics},
        "artifact_bytes": sum(artifacts.values()), "weights_bytes": weights,
        "artifact_bytes_over_weights": sum(artifacts.values()) / weights if weights else None,
        "optimizer_state_logged": any(p.startswith("checkpoints/") for p in artifacts),
        "model_uri": ex.model_uri, "export_validated": version.tags.get(names.EXPORT_VALIDATED),
        "checkpoint": ft.checkpoint,
    }


def child(part: str, shape: str, work: str) -> dict:
    env = dict(os.environ)  # a part's settings (DeepSpeed's RANK/MASTER_PORT, MLflow's URI) stay with it
    try:
        if part == "train_step":
            return part_train_step(shape)
        if part == "attention":
            return part_attention(shape)
        if part == "step_profile":
            return part_step_profile(shape)
        return part_finetune(shape, Path(work) / part)
    except Skip as e:
        return {"skipped": str(e)}
    except Exception as e:  # noqa: BLE001 (recorded; the next part still runs)
        import traceback

        return {"error": "".join(traceback.format_exception(e))[-3000:]}
    finally:
        os.environ.clear()
        os.environ.update(env)


def _machine() -> dict:
    info = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.cuda.is_available()
        if info["cuda"]:
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        info["torch"] = None
    for mod in ("deepspeed", "speculators", "mlflow", "transformers"):
        try:
            from importlib.metadata import version

            info[mod] = version(mod)
        except Exception:  # noqa: BLE001
            info[mod] = None
    return info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="real", choices=["real", "tiny"])
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--budget-s", type=float, default=440.0, help="all parts together (each gets its share)")
    ap.add_argument("--child", nargs=3, metavar=("PART", "SHAPE", "WORK"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        parts, shape, work = args.child
        for part in parts.split(","):
            t = time.perf_counter()
            res = child(part, shape, work)
            res["wall_s"] = round(time.perf_counter() - t, 1)
            print(f"{MARK}{part} " + json.dumps(res, default=str), flush=True)
        return 0
    parts = [p for p in args.parts.split(",") if p]
    for part in parts:
        if part not in PARTS:
            ap.error(f"unknown part {part!r}: choose from {', '.join(PARTS)}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"benchmark": "gpu-check", "shape": args.shape, "date": time.strftime("%Y-%m-%d %H:%M"),
              "machine": _machine(), "standins": standins(), "parts": {}}
    # real: one process per part (an out-of-memory or a crash loses one part); tiny: one process for all
    groups = [[p] for p in parts] if args.shape == "real" else [parts]
    with tempfile.TemporaryDirectory(prefix="draftline-gpu-check-") as tmp:
        for group in groups:
            for part, res in run_group(group, args.shape, Path(tmp), args.budget_s).items():
                result["parts"][part] = res
                state = "skipped" if "skipped" in res else "error" if "error" in res else "ok"
                why = (res.get("skipped") or res.get("error") or "")[-400:]
                print(f"gpu-check {part}: {state} ({res.get('wall_s')} s)" + (f": {why}" if why else ""), flush=True)
            out.write_text(json.dumps(result, indent=2, default=str) + "\n")  # kept if a later part hangs
    print(f"-> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
