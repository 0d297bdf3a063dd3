"""train-step: our DeepSpeed step (ZeRO 1, 2, 3) against a bare PyTorch AdamW step, interleaved in one run.

Same ``Eagle3DraftModel`` (fresh copy per variant, same seed), same packed batch, same optimiser settings.
One rank (in-process; gloo on the CPU, NCCL on a GPU). ``--shape real`` is the Kimi-K2 drafter (hidden 7168,
draft vocab 32000): a GPU job.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from benchmarks.common import bench_model, fake_batch


def _bare_step(model, batch, ttt, cfg):
    from draftline.drafter.model import forward, trainable_parameters

    params = trainable_parameters(model)
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95))

    def step():
        loss, _ = forward(model, batch, ttt, cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
    return step


def _ds_step(model, batch, ttt, cfg, stage):
    import deepspeed

    from draftline.config import FinetuneConfig
    from draftline.drafter.model import forward, trainable_parameters
    from draftline.train.finetune import ds_config

    conf = ds_config(FinetuneConfig(data="-", zero_stage=stage, steps=10_000, lr=1e-4))
    if stage == 3:
        conf["zero_optimization"]["stage3_param_persistence_threshold"] = 0  # partition even small tensors
    engine, *_ = deepspeed.initialize(model=model, model_parameters=trainable_parameters(model), config=conf)

    def step():
        loss, _ = forward(engine, batch, ttt, cfg)
        engine.backward(loss)
        engine.step()
    return step


def _time(step, warmup: int, iters: int, sync) -> list[float]:
    for _ in range(warmup):
        step()
    sync()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t)
    return times


def _speedup(ratios: dict[str, list[float]], attn: str, against: str) -> dict:
    """zero2's speedup over ``zero2@<against>``, per round (both ratios are to the same round's bare step)."""
    per_round = [o / z for o, z in zip(ratios[f"zero2@{against}"], ratios["zero2"], strict=True)]
    lo, mid, hi = min(per_round), statistics.median(per_round), max(per_round)
    return {"zero2_speedup_over_" + against: {"median": mid, "per_round": per_round, "spread": [lo, hi]},
            "summary": {f"zero2 ({attn}) vs zero2@{against}": f"x{mid:.2f} [{lo:.2f}, {hi:.2f}] tokens/s, per round"}}


def run(shape: str = "tiny", tokens: int = 512, iters: int = 8, warmup: int = 2, stages=(1, 2, 3),
        rounds: int = 3, attn: str = "auto", against: str | None = None) -> dict:
    """Every variant is built first; then ``rounds`` rounds each time ``iters`` steps of every variant, the order
    rotated each round, so a busy machine slows all variants alike. Each round gives one ratio per variant
    (its median step over bare's median step in that round); the result is the median ratio and its spread
    over rounds, and a ratio whose spread includes 1.0 is reported as not distinguishable from bare.

    ``attn`` is the draft attention of every variant (``auto``: finetune's choice on this device); ``against``
    adds ``zero2@<against>``, finetune's ZeRO-2 step with that attention instead, and the per-round speedup of
    ``zero2`` over it."""
    import deepspeed

    from draftline.drafter.attention import choose
    from draftline.drafter.model import loss_config

    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ["DS_ACCELERATOR"] = "cpu"
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "29517"}.items():
        os.environ.setdefault(k, v)
    if not cuda:
        from draftline.train.worker import no_shm_allreduce

        no_shm_allreduce()  # as finetune's ranks do
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    device = torch.device("cuda" if cuda else "cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    cfg, ttt = loss_config(), 3
    attn = choose(attn, on_cpu=not cuda)
    names = ["bare", *(f"zero{s}" for s in stages), *([f"zero2@{against}"] if against else [])]
    steps, peak = {}, {}
    for name in names:  # built one at a time: the others sit idle, so each variant's own peak is measurable
        before = torch.cuda.memory_allocated() if cuda else 0
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        torch.manual_seed(0)
        model = bench_model(shape, device, attn=name.partition("@")[2] or attn)
        batch = fake_batch(model, tokens, device)
        stage = None if name == "bare" else int(name[4:].partition("@")[0])
        steps[name] = _bare_step(model, batch, ttt, cfg) if stage is None else _ds_step(model, batch, ttt, cfg, stage)
        _time(steps[name], max(warmup, 1), 0, sync)
        if cuda:  # this variant's peak over build, engine and a step, without what the other variants hold
            peak[name] = (torch.cuda.max_memory_allocated() - before) / 2**30
    times: dict[str, list[float]] = {n: [] for n in names}
    ratios: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        medians = {}
        for name in order:
            t = _time(steps[name], 0, iters, sync)
            times[name] += t
            medians[name] = statistics.median(t)
        for name in names:
            ratios[name].append(medians[name] / medians["bare"])
    results = {}
    for name in names:
        med = statistics.median(times[name])
        lo, hi = min(ratios[name]), max(ratios[name])
        results[name] = {"step_s_median": med, "step_s_all": times[name], "tokens_per_s": tokens / med,
                         "ratio_to_bare": statistics.median(ratios[name]), "ratio_per_round": ratios[name],
                         "ratio_spread": [lo, hi],
                         "distinguishable_from_bare": name == "bare" or not (lo <= 1.0 <= hi)}
        if cuda:
            results[name]["peak_gpu_mem_gib"] = peak[name]  # build + engine + one step, this variant alone
    out = _speedup(ratios, attn, against) if against else {}
    return {**out, "shape": shape, "device": str(device), "attn": attn, "tokens_per_step": tokens, "iters": iters,
            "rounds": rounds,
            "method": "variants interleaved, order rotated each round; ratio = median over rounds of the "
                      "round's median step / bare's; spread = min..max over rounds",
            "targets": {"zero2": 1.10, "zero3": 1.25}, "variants": results}
