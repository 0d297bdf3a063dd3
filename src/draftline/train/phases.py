"""The real run, planned end to end: how long each phase takes, on which nodes, and what it asks of the disk.

The phases run one after another (the verifier fills the team's 8 GPUs): the serving endpoint answers the prompts
(regeneration), a vLLM holding the verifier captures their hidden states (capture), DeepSpeed trains the drafter
(training), vLLM measures it beside the verifier (evaluation). Rates that depend on a deployment are assumptions,
stated with the plan and given as flags; the training step comes from the plan's own compute and interconnect
model (:mod:`draftline.train.interconnect`), the bytes from the shards' format (:mod:`draftline.data.storage`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Assumptions:
    """What the plan cannot know about a deployment: measure yours and pass it (``draftline plan --help``)."""

    regenerate_tokens_per_s: float = 1500.0  # the serving endpoint's aggregate decode rate at high concurrency
    capture_tokens_per_s: float = 20000.0  # the verifier's prefill rate with hidden-state extraction on 8 GPUs
    disk_gb_s: float = 3.0  # the shards' file system, read and write (a local NVMe)
    verifier_gb: float = 554.0  # Kimi-K2.5's INT4 checkpoint
    verifier_load_gb_s: float = 2.0  # how fast vLLM reads the verifier at start
    vllm_start_overhead_s: float = 180.0  # beyond reading the weights: compile, CUDA graphs, KV-cache profiling
    eval_prompts: int = 64  # the evaluation set evaluate serves
    eval_tokens: int = 512  # tokens generated per evaluation prompt
    eval_servers: int = 2  # vLLM starts evaluate makes: without the drafter and with it (--sweep-k adds one per k)


@dataclass(frozen=True)
class Phase:
    name: str
    seconds: float
    nodes: str
    disk_gb_s: float  # what it asks of the shards' file system (0: none)
    disk_bound: bool  # the disk, not the GPUs, sets its time
    detail: str


def vllm_start_s(a: Assumptions) -> float:
    return a.verifier_gb / a.verifier_load_gb_s + a.vllm_start_overhead_s


def phases(*, samples: int, tokens_per_sample: int, reply_tokens: int, epochs: float | None, gpus: int, nodes: int,
           tokens_per_batch: int, step_s: float | None, bytes_per_token: int, steps: int = 200,
           assumptions: Assumptions = Assumptions()) -> dict:
    """Each phase's time, nodes and disk bandwidth, and the training's steps: ``epochs`` passes over ``samples``
    x ``tokens_per_sample`` tokens, ``gpus`` x ``nodes`` ranks packing ``tokens_per_batch`` each, or (``epochs``
    None) ``steps``, as finetune counts them."""
    a = assumptions
    start = vllm_start_s(a)
    tokens = samples * tokens_per_sample
    regen_s = samples * reply_tokens / a.regenerate_tokens_per_s
    capture_write = a.capture_tokens_per_s * bytes_per_token / 1e9
    capture_rate = min(a.capture_tokens_per_s, a.disk_gb_s * 1e9 / bytes_per_token)
    capture_s = start + tokens / capture_rate
    ranks = gpus * nodes
    if epochs is None:
        epochs = steps * ranks * tokens_per_batch / tokens
    else:
        steps = max(1, math.ceil(epochs * tokens / (ranks * tokens_per_batch)))
    read_per_step = ranks * tokens_per_batch * bytes_per_token
    step = step_s if step_s else 0.0
    train_read = read_per_step / step / 1e9 if step else 0.0  # at the GPUs' pace (unknown without their TFLOP/s)
    step_taken = max(step, read_per_step / (a.disk_gb_s * 1e9))
    eval_s = a.eval_servers * start + a.eval_prompts * a.eval_tokens / a.regenerate_tokens_per_s
    out = [
        Phase("regeneration", regen_s, "the serving node (its endpoint answers, serving goes on)", 0.0, False,
              f"{samples:,} replies x {reply_tokens:,} tokens at {a.regenerate_tokens_per_s:,.0f} tokens/s"),
        Phase("capture", capture_s, "a node holding the verifier: the serving node once serving stops, or a "
              "second 8-GPU node", capture_write, capture_rate < a.capture_tokens_per_s,
              f"vLLM start {start / 60:.0f} min, then {tokens:,} tokens at {capture_rate:,.0f} tokens/s, writing "
              f"{bytes_per_token:,} bytes a token"),
        Phase("training", steps * step_taken, f"{nodes} node(s) x {gpus} GPUs (the drafter only, no verifier)",
              train_read, step_taken > step,
              f"{steps:,} steps ({epochs:.3g} epoch(s)) of {step_taken * 1e3:.0f} ms, each reading "
              f"{read_per_step / 1e9:.1f} GB of shards"),
        Phase("evaluation", eval_s, "a node holding the verifier and the drafter (as capture)", 0.0, False,
              f"{a.eval_servers} vLLM starts, {a.eval_prompts} prompts x {a.eval_tokens} tokens"),
    ]
    return {"phases": [asdict(p) for p in out], "total_s": sum(p.seconds for p in out), "steps": steps,
            "epochs": epochs, "samples": samples, "tokens_per_sample": tokens_per_sample,
            "reply_tokens": reply_tokens, "assumptions": asdict(a)}


def lines(plan: dict) -> list[str]:
    """The phases as the plan prints them."""
    def hours(s: float) -> str:
        return f"{s / 3600:.1f} h" if s >= 3600 else f"{s / 60:.0f} min"

    out = ["", f"the run, phase by phase ({plan['samples']:,} samples x {plan['tokens_per_sample']:,} tokens, "
               f"{plan['reply_tokens']:,} of them generated; {plan['epochs']:.3g} epoch(s) = {plan['steps']:,} steps):"]
    for p in plan["phases"]:
        disk = f"; disk {p['disk_gb_s']:.1f} GB/s" if p["disk_gb_s"] else ""
        bound = ": the disk sets this pace" if p["disk_bound"] else ""
        out.append(f"  {p['name']:<13}{hours(p['seconds']):>9}  {p['detail']}{disk}{bound}")
        out.append(f"  {'':<13}{'':>9}  on {p['nodes']}")
    a = plan["assumptions"]
    out.append(f"  in all {hours(plan['total_s'])}; assumed (measure yours, flags of the same names): "
               f"--regenerate-tokens-per-s {a['regenerate_tokens_per_s']:g}, --capture-tokens-per-s "
               f"{a['capture_tokens_per_s']:g}, --disk-gb-s {a['disk_gb_s']:g}, a {a['verifier_gb']:g} GB verifier "
               f"read at {a['verifier_load_gb_s']:g} GB/s + {a['vllm_start_overhead_s']:g} s a vLLM start")
    return out
