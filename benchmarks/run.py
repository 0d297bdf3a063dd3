"""Run one benchmark, write ``benchmarks/results/<name>[-<shape>].json`` and print a short table.

    python -m benchmarks.run NAME [options]   one subcommand per benchmark, each with only its own options
    python -m benchmarks.run --help           every benchmark, a line each (the table BENCHMARKS below)
    python -m benchmarks.run NAME --help      what NAME measures (its module's docstring) and its options

A benchmark NAME is the module ``benchmarks/<name with - as _>.py``; its options are the keyword arguments of
that module's ``run`` (an option left unset is not passed, so ``run``'s own default applies). The module is
imported only when its subcommand runs: most import torch, vLLM or MLflow.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import platform
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
SHAPES = ("tiny", "real", "smollm2")  # benchmarks.common.SHAPES, not imported: it imports torch


def _csv(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def _ints(text: str) -> list[int]:
    return [int(x) for x in _csv(text)]


def shape(default: str, which: str) -> tuple[str, dict]:
    return "--shape", dict(default=default, choices=SHAPES, help=f"{which} (default: %(default)s)")


def steps(what: str, default: int = 60) -> tuple[str, dict]:
    return "--steps", dict(type=int, default=default, metavar="N", help=f"{what} (default: %(default)s)")


PARENT = "--parent", dict(default=None, metavar="DIR",
                          help="the parent directory, or random (default: the last ./demo_real.sh run's)")

# name -> (one line for --help, its options as (flag, argparse keywords)); dest is run's keyword argument
BENCHMARKS: dict[str, tuple[str, list[tuple[str, dict]]]] = {
    "train-step": ("our DeepSpeed step (ZeRO 1, 2, 3) vs a bare PyTorch AdamW step", [
        shape("tiny", "tiny, or real: the Kimi-K2 drafter (a GPU job)"),
        ("--tokens", dict(type=int, default=512, metavar="N", help="tokens per step (default: %(default)s)")),
        ("--iters", dict(type=int, default=8, metavar="N", help="steps per variant a round (default: %(default)s)")),
        ("--rounds", dict(type=int, default=3, metavar="N",
                          help="interleaved rounds, >= 3 for a spread (default: %(default)s)")),
        ("--attn", dict(default="auto", metavar="IMPL",
                        help="draft attention of every variant (default: %(default)s, finetune's choice)")),
        ("--against", dict(default=None, metavar="IMPL",
                           help="also ZeRO-2 with this attention, and zero2's speedup over it (e.g. sdpa)"))]),
    "drafter-layers": ("a Llama-layer vs an MLA-layer drafter's training step, blockwise and sdpa each", [
        ("--shape", dict(default="kimi", choices=("kimi", "real"),
                         help="kimi: the Kimi-shaped miniature; real: Kimi-K2's Llama vs Kimi-K2.5's MLA layer "
                              "(a GPU job) (default: %(default)s)")),
        ("--tokens", dict(type=int, default=512, metavar="N", help="tokens per step (default: %(default)s)")),
        ("--iters", dict(type=int, default=6, metavar="N", help="steps per variant a round (default: %(default)s)")),
        ("--rounds", dict(type=int, default=5, metavar="N", help="interleaved rounds (default: %(default)s)"))]),
    "eagle-form-step": ("an EAGLE 3.1 drafter's training step vs the same drafter in 3.0, interleaved (Kimi "
                        "miniature's MLA layer, SmolLM2's Llama layer)", [
        ("--tokens", dict(type=int, default=512, metavar="N", help="tokens per step (default: %(default)s)")),
        ("--iters", dict(type=int, default=6, metavar="N", help="steps per variant a round (default: %(default)s)")),
        ("--rounds", dict(type=int, default=5, metavar="N", help="interleaved rounds (default: %(default)s)"))]),
    "layers-served": ("Llama- vs MLA-layer Kimi drafter at equal data and steps, served by vLLM (after "
                      "./demo_kimi.sh)", [
        steps("finetune steps of each drafter", default=100),
        ("--seed", dict(type=int, default=0, metavar="N", help="the seed of both (default: %(default)s)")),
        ("--max-new-tokens", dict(type=int, default=24, metavar="N", help="tokens per prompt (default: %(default)s)")),
        ("--concurrency", dict(default="1", metavar="C,C", help="speed-up concurrencies (default: %(default)s)"))]),
    "eagle-forms": ("EAGLE 3.0 vs 3.1 drafter at equal data and steps, served by vLLM (after ./demo_kimi.sh or "
                    "./demo_real.sh)", [
        ("--shape", dict(default="kimi", choices=("kimi", "smollm2"),
                         help="kimi: MLA drafters, after ./demo_kimi.sh; smollm2: SmolLM2's Llama layer, after "
                              "./demo_real.sh (default: %(default)s)")),
        steps("finetune steps of each drafter", default=100),
        ("--seed", dict(type=int, default=0, metavar="N", help="the seed of both (default: %(default)s)")),
        ("--max-new-tokens", dict(type=int, default=24, metavar="N", help="tokens per prompt (default: %(default)s)")),
        ("--concurrency", dict(default="1", metavar="C,C", help="speed-up concurrencies (default: %(default)s)"))]),
    "aux-translation": ("a parent trained on SGLang-counted layers, finetuned with and without the translation to "
                        "vLLM's count, served by vLLM (after ./demo_kimi.sh)", [
        steps("finetune steps of each child", default=100),
        ("--parent-steps", dict(type=int, default=200, metavar="N",
                                help="the parent's steps from random init (default: %(default)s)")),
        ("--seed", dict(type=int, default=0, metavar="N", help="the children's seed (default: %(default)s)")),
        ("--max-new-tokens", dict(type=int, default=24, metavar="N", help="tokens per prompt (default: %(default)s)"))]),
    "fp8-shards": ("fp8 vs bf16 shards of the same capture: served acceptance by vLLM and bytes (after "
                   "./demo_kimi.sh or ./demo_real.sh)", [
        ("--shape", dict(default="kimi", choices=("kimi", "smollm2"),
                         help="kimi: after ./demo_kimi.sh; smollm2: after ./demo_real.sh (default: %(default)s)")),
        steps("finetune steps on each", default=100),
        ("--seed", dict(type=int, default=0, metavar="N", help="the seed of both (default: %(default)s)")),
        ("--max-new-tokens", dict(type=int, default=24, metavar="N", help="tokens per prompt (default: %(default)s)"))]),
    "speed": ("tokens/s with vs without the drafter on vLLM, as evaluate measures it (after a demo)", [
        ("--shape", dict(default="kimi", choices=("kimi", "smollm2"),
                         help="kimi: after ./demo_kimi.sh; smollm2: after ./demo_real.sh (default: %(default)s)")),
        ("--target", dict(default=None, metavar="URI", help="the drafter (default: the newest finetune run)")),
        ("--data", dict(default=None, metavar="URI", help="the evaluation set (default: the newest 'evaluation')")),
        ("--concurrency", dict(default="1,8", metavar="C,C", help="concurrencies (default: %(default)s)")),
        ("--max-new-tokens", dict(type=int, default=48, metavar="N", help="tokens per prompt (default: %(default)s)")),
        ("--max-prompts", dict(type=int, default=16, metavar="N", help="prompts (default: %(default)s)")),
        ("--sweep-k", dict(default=None, metavar="1..K", help="also each k, the fastest named (default: off)"))]),
    "parent-load": ("load + remap of an AQ-MedAI-layout parent vs reading its tensors", [
        shape("real", "real (a 2.4 GB checkpoint) or tiny")]),
    "warm-start": ("finetune steps from the parent vs from random init (smollm2: after ./demo_real.sh)", [
        shape("tiny", "tiny, or smollm2: a finished ./demo_real.sh run"),
        ("--warm-start-steps", dict(type=int, default=None, dest="steps", metavar="N",
                                    help="smollm2: train both sides at this budget (default: the child's steps)"))]),
    "ui-screenshot": ("the MLflow UI's page of a drafter, evaluated beside served, as PNGs for the docs", [
        ("--registered-model", dict(default="smollm2-gsm8k-drafter", metavar="NAME", dest="registered",
                        help="the registered drafter (default: %(default)s, after ./demo_real.sh)")),
        ("--version", dict(default=None, metavar="N", help="its version (default: the newest)")),
        ("--no-observe", dict(action="store_false", dest="observe",
                              help="take the pages as they are (default: serve it on vLLM and observe first)")),
        ("--window", dict(type=float, default=30.0, dest="window_s", metavar="S",
                          help="observe's window (default: %(default)s)")),
        ("--verifier", dict(default=None, metavar="DIR", help="the verifier here (default: its lineage's path)"))]),
    "plan": ("both Kimi drafters on 8 x RTX PRO 6000 (PCIe), per ZeRO stage; the shards of 25,000 samples", []),
    "ci": ("CI's time: a fresh clone of a commit, its .ci/run as CI runs it", [
        ("--ref", dict(default="HEAD", metavar="REF", help="the commit to clone and run (default: %(default)s)"))]),
    "registry": ("register -> pull through a local mlflow server vs MLflow's own upload / download", [
        shape("real", "real (2.3 GB) or tiny"),
        ("--on", dict(default="disk", choices=("disk", "reflink"),
                      help="where the pulls land: the benchmark's folder, or an XFS with reflink mounted for the "
                      "run (root, xfsprogs) (default: %(default)s)"))]),
    "data": ("capture tokens/s, shard bytes per token, loader vs train step", []),
    "regenerate": ("tiny server: batched vs one request at a time", []),
    "evaluation": ("measured vs teacher-forced acceptance, tiny verifier", []),
    "serving": ("real vLLM vs tiny_server and in-process (smollm2: --drafter DIR)", [
        shape("tiny", "tiny, or smollm2 (needs --drafter)"),
        ("--drafter", dict(default=None, dest="drafter_dir", metavar="DIR",
                           help="--shape smollm2: the drafter directory to serve")),
        ("--prompts", dict(type=int, default=16, dest="prompts_n", metavar="N",
                           help="prompts per variant (default: %(default)s)"))]),
    "scaling": ("served acceptance against data, same compute", [
        ("--sizes", dict(type=_ints, default="64,256,768", metavar="N,N,...",
                         help="nested subsets of the team's GSM8K train prompts, at most 1800 (the parent's 200 "
                              "never among them) (default: %(default)s)")),
        steps("finetune steps for every size (same compute)", default=300),
        ("--val-every", dict(type=int, default=None, metavar="N",
                             help="validate every child every N steps on the last 64 GSM8K test prompts and keep "
                                  "its walked curve: the steps axis (-> scaling-smollm2-curves.json)")),
        ("--eval-prompts", dict(type=int, default=16, metavar="N",
                                help="GSM8K test prompts served by vLLM per point (default: %(default)s)")),
        ("--max-new-tokens", dict(type=int, default=48, metavar="N",
                                  help="tokens generated per evaluation prompt (default: %(default)s)")),
        PARENT,
        ("--replot", dict(action="store_true",
                          help="draw the plot again from the results only (after a new full real-tier run)"))]),
    "recipe": ("one finetune setting changed at a time, served by vLLM", [
        ("--variants", dict(type=_csv, default="base,lr-1e-3,lr-2e-3", metavar="NAME,...",
                            help="variants to measure against base, benchmarks/recipe.py VARIANTS "
                                 "(default: %(default)s)")),
        ("--conversations", dict(type=int, default=64, metavar="N",
                                 help="GSM8K train conversations (default: %(default)s)")),
        steps("finetune steps for every variant"),
        ("--on-top-of", dict(type=lambda text: tuple(_csv(text)), default="", metavar="NAME,...",
                             help="variants already kept, folded into base for this round")),
        PARENT]),
    "fleet": ("concurrent pulls by stage while Production moves, vs MLflow's download", [
        ("--pullers", dict(type=_ints, default="1,8,32", dest="counts", metavar="N,N,...",
                           help="concurrent pullers per round (default: %(default)s)")),
        ("--auth-cache-ttl", dict(type=int, default=60, dest="auth_cache_ttl_s", metavar="S",
                                  help="the server's auth_cache_ttl_seconds, 0: MLflow's default, a hash check "
                                       "a request (default: %(default)s)"))]),
    "server-requests": ("one request, one download: sqlite/PostgreSQL, with/without auth", []),
    "prediction": ("a finished ./demo_real.sh run: what teacher-forced predicts vs vLLM", []),
    "real-tier": ("a finished ./demo_real.sh run -> real-tier-smollm2-<scale>.json", [
        ("--log", dict(default=None, metavar="LOG", help="demo_real.sh's stderr (default: work/real/demo.log)"))]),
    "artifact-bytes": ("what finetune logs / bf16 weight bytes", [shape("real", "real or tiny")]),
    "capture": ("vLLM vs transformers capture, Llama and Kimi-shaped tiny", []),
    "bf16-ties": ("bf16 speculative vs plain decoding on vLLM, Kimi-shaped", [
        ("--prompts", dict(type=int, default=64, dest="prompts_n", metavar="N",
                           help="GSM8K prompts (default: %(default)s)"))]),
    "step-profile": ("where a training step's time goes", [
        shape("smollm2", "smollm2 (the real tier's drafter) or tiny"),
        ("--tokens", dict(type=int, default=1024, metavar="N",
                          help="tokens per step, as a rank of the real tier takes them (default: %(default)s)")),
        ("--rounds", dict(type=int, default=5, metavar="N",
                          help="interleaved rounds, one step of every variant each (default: %(default)s)")),
        ("--threads", dict(type=int, default=1, metavar="N",
                           help="threads, as a rank has them: 1 = two ranks on two cores (default: %(default)s)"))]),
}


def _module(name: str) -> str:
    return f"benchmarks.{name.replace('-', '_')}"


def _about(name: str) -> str | None:
    """The benchmark module's docstring, read without importing the module."""
    path = HERE / f"{name.replace('-', '_')}.py"
    return ast.get_docstring(ast.parse(path.read_text())) if path.exists() else None


def parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    ap = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__, formatter_class=raw)
    sub = ap.add_subparsers(dest="name", metavar="NAME", required=True, title="benchmarks")
    for name, (line, options) in BENCHMARKS.items():
        p = sub.add_parser(name, help=line, description=_about(name) or line, formatter_class=raw)
        for flag, kwargs in options:
            p.add_argument(flag, **kwargs)
    return ap


def _table(result: dict) -> str:
    rows = []
    for name, v in result.get("variants", {}).items():
        extra = f"  peak {v['peak_gpu_mem_gib']:.1f} GiB" if "peak_gpu_mem_gib" in v else ""
        spread = ""
        if "ratio_spread" in v and name != "bare":
            lo, hi = v["ratio_spread"]
            spread = f" ({lo:.2f}-{hi:.2f}{'' if v['distinguishable_from_bare'] else ', overlaps bare'})"
        rows.append(f"  {name:<8} {v['step_s_median'] * 1000:9.1f} ms/step  {v['tokens_per_s']:10.0f} tok/s  "
                    f"x{v['ratio_to_bare']:.2f} bare{spread}{extra}")
    for k, v in result.get("summary", {}).items():
        rows.append(f"  {k:<28} {v}")
    return "\n".join(rows)


def main(argv=None) -> int:
    kwargs = vars(parser().parse_args(argv))
    name = kwargs.pop("name")
    if kwargs.pop("replot", False):  # scaling --replot: the figures are the earlier run's, so keep its record
        importlib.import_module(_module(name)).replot()
        print(f"scaling: {RESULTS / 'scaling-smollm2.png'} drawn again from {RESULTS / 'scaling-smollm2.json'}")
        return 0
    t0 = time.time()
    result = importlib.import_module(_module(name)).run(**{k: v for k, v in kwargs.items() if v is not None})
    result.update({"benchmark": name, "wall_s": round(time.time() - t0, 1),
                   "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
                   "date": time.strftime("%Y-%m-%d")})
    RESULTS.mkdir(exist_ok=True)
    suffix = f"-{result.get('shape')}" if result.get("shape") else ""
    out = RESULTS / f"{name}{suffix}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{name} ({result.get('shape')}, {result.get('device', 'cpu')}) -> {out}\n{_table(result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
