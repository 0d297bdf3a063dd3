"""Run one benchmark, write ``benchmarks/results/<name>.json`` and print a short table.

    python -m benchmarks.run train-step [--shape tiny|real] [--tokens N] [--iters N] [--rounds N]
    python -m benchmarks.run parent-load [--shape real|tiny]
    python -m benchmarks.run warm-start [--shape tiny|smollm2 --warm-start-steps N]   (smollm2: after ./demo_real.sh)
    python -m benchmarks.run plan                   (the Kimi-K2 drafter on 8 x 180 GiB, per ZeRO stage)
    python -m benchmarks.run registry [--shape real|tiny]
    python -m benchmarks.run data
    python -m benchmarks.run regenerate             (tiny server: batched vs one request at a time)
    python -m benchmarks.run evaluation             (measured vs teacher-forced acceptance, tiny verifier)
    python -m benchmarks.run serving [--shape smollm2 --drafter DIR]  (real vLLM vs tiny_server and in-process)
    python -m benchmarks.run scaling [--sizes 16,64,128 --steps 60]  (served acceptance against data, same compute)
    python -m benchmarks.run recipe [--variants base,lr-2e-3 --conversations 64 --steps 60]  (one change each, served)
    python -m benchmarks.run fleet [--pullers 1,8,32] [--auth-cache-ttl S]  (pulls by stage while Production moves)
    python -m benchmarks.run server-requests        (one request, one download: sqlite/PostgreSQL, with/without auth)
    python -m benchmarks.run prediction             (a finished ./demo_real.sh run: what teacher-forced predicts vs vLLM)
    python -m benchmarks.run real-tier [--log LOG]  (a finished ./demo_real.sh run -> real-tier-smollm2-<scale>.json)
    python -m benchmarks.run artifact-bytes [--shape real|tiny]  (what finetune logs / bf16 weight bytes)
    python -m benchmarks.run capture                (vLLM vs transformers capture, Llama and Kimi-shaped tiny)
    python -m benchmarks.run bf16-ties              (bf16 speculative vs plain decoding on vLLM, Kimi-shaped)
    python -m benchmarks.run step-profile [--shape smollm2|tiny --tokens N]  (where a training step's time goes)
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


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


def main(argv=None) -> int:  # noqa: C901  (one branch per benchmark name, as the usage above lists them)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", choices=["train-step", "parent-load", "warm-start", "registry", "plan", "data",
                                         "regenerate", "evaluation", "fleet", "real-tier", "artifact-bytes",
                                         "server-requests", "serving", "scaling", "recipe", "prediction", "capture",
                                         "step-profile", "bf16-ties"])
    ap.add_argument("--shape", default=None, choices=["tiny", "real", "smollm2"])  # step-profile: smollm2|tiny
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3, help="train-step: interleaved rounds (>= 3 for a spread)")
    ap.add_argument("--pullers", default="1,8,32", help="fleet: concurrent pullers per round")
    ap.add_argument("--auth-cache-ttl", type=int, default=60,
                    help="fleet: the server's auth_cache_ttl_seconds (0: MLflow's default, a hash check a request)")
    ap.add_argument("--drafter", default=None, help="serving --shape smollm2: the drafter directory to serve")
    ap.add_argument("--prompts", type=int, default=16, help="serving: prompts per variant")
    ap.add_argument("--sizes", default="16,64,128", help="scaling: nested subsets of GSM8K train conversations")
    ap.add_argument("--steps", type=int, default=60, help="scaling: finetune steps for every size (same compute)")
    ap.add_argument("--variants", default="base,lr-1e-3,lr-2e-3",
                    help="recipe: variants to measure against base (benchmarks/recipe.py VARIANTS)")
    ap.add_argument("--conversations", type=int, default=64, help="recipe: GSM8K train conversations")
    ap.add_argument("--on-top-of", default="", help="recipe: variants already kept, folded into base for this round")
    ap.add_argument("--warm-start-steps", type=int, default=None,
                    help="warm-start --shape smollm2: train both sides at this budget (default: the child's steps)")
    ap.add_argument("--parent", default=None,
                    help="scaling, recipe: the parent directory (default: the last demo_real.sh run's) or random")
    ap.add_argument("--replot", action="store_true", help="scaling: draw the plot again from the results only")
    ap.add_argument("--log", default=None, help="real-tier: demo_real.sh's stderr (default work/real/demo.log)")
    args = ap.parse_args(argv)
    t0 = time.time()
    if args.name == "train-step":
        from benchmarks.train_step import run

        result = run(shape=args.shape or "tiny", tokens=args.tokens, iters=args.iters, rounds=args.rounds)
    elif args.name == "warm-start":
        from benchmarks.warm_start import run

        result = run(shape=args.shape or "tiny", **({"steps": args.warm_start_steps} if args.warm_start_steps else {}))
    elif args.name == "plan":
        from benchmarks.plan import run

        result = run()
    elif args.name == "evaluation":
        from benchmarks.evaluation import run

        result = run()
    elif args.name == "real-tier":
        from benchmarks.real_tier import run

        result = run(log=args.log)
    elif args.name == "prediction":
        from benchmarks.prediction import run

        result = run()
    elif args.name == "data":
        from benchmarks.data import run

        result = run()
    elif args.name == "regenerate":
        from benchmarks.regenerate import run

        result = run()
    elif args.name == "fleet":
        from benchmarks.fleet import run

        result = run(counts=[int(x) for x in args.pullers.split(",")], auth_cache_ttl_s=args.auth_cache_ttl)
    elif args.name == "serving":
        from benchmarks.serving import run

        result = run(shape=args.shape or "tiny", drafter_dir=args.drafter, prompts_n=args.prompts)
    elif args.name == "scaling":
        from benchmarks.scaling import replot, run

        result = replot() if args.replot else run(sizes=[int(x) for x in args.sizes.split(",")], steps=args.steps,
                                                  parent=args.parent)
    elif args.name == "recipe":
        from benchmarks.recipe import run

        result = run(variants=args.variants.split(","), conversations=args.conversations, steps=args.steps,
                     on_top_of=tuple(x for x in args.on_top_of.split(",") if x), parent=args.parent)
    elif args.name == "server-requests":
        from benchmarks.server_requests import run

        result = run()
    elif args.name == "artifact-bytes":
        from benchmarks.artifact_bytes import run

        result = run(shape=args.shape or "real")
    elif args.name == "capture":
        from benchmarks.capture import run

        result = run()
    elif args.name == "step-profile":
        from benchmarks.step_profile import run

        result = run(shape=args.shape or "smollm2", tokens=args.tokens if args.tokens != 512 else 1024,
                     iters=args.iters if args.iters != 8 else 3)
    elif args.name == "bf16-ties":
        from benchmarks.bf16_ties import run

        result = run(prompts_n=args.prompts if args.prompts != 16 else 64)
    elif args.name == "registry":
        from benchmarks.registry import run

        result = run(shape=args.shape or "real")
    else:
        from benchmarks.parent_load import run

        result = run(shape=args.shape or "real")
    if getattr(args, "replot", False) and args.name == "scaling":  # the figures are the earlier run's: keep its record
        print(f"scaling: {RESULTS / 'scaling-smollm2.png'} drawn again from {RESULTS / 'scaling-smollm2.json'}")
        return 0
    result.update({"benchmark": args.name, "wall_s": round(time.time() - t0, 1),
                   "machine": {"cpus": __import__("os").cpu_count(), "platform": platform.platform()},
                   "date": time.strftime("%Y-%m-%d")})
    RESULTS.mkdir(exist_ok=True)
    suffix = f"-{result.get('shape')}" if result.get("shape") else ""
    out = RESULTS / f"{args.name}{suffix}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{args.name} ({result.get('shape')}, {result.get('device', 'cpu')}) -> {out}\n{_table(result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
