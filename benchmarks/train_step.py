"""train-step: our DeepSpeed step (ZeRO 1, 2, 3) against a bare PyTorch AdamW step, side by side in one run.

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
    from draftline.train.model import forward, trainable_parameters

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
    from draftline.train.finetune import ds_config
    from draftline.train.model import forward, trainable_parameters

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


def run(shape: str = "tiny", tokens: int = 512, iters: int = 8, warmup: int = 2, stages=(1, 2, 3)) -> dict:
    import deepspeed

    from draftline.train.model import loss_config

    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ["DS_ACCELERATOR"] = "cpu"
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "29517"}.items():
        os.environ.setdefault(k, v)
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    device = torch.device("cuda" if cuda else "cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    cfg, ttt = loss_config(), 3
    variants = {"bare": None, **{f"zero{s}": s for s in stages}}
    results = {}
    for name, stage in variants.items():
        torch.manual_seed(0)
        model = bench_model(shape, device)
        batch = fake_batch(model, tokens, device)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        step = _bare_step(model, batch, ttt, cfg) if stage is None else _ds_step(model, batch, ttt, cfg, stage)
        times = _time(step, warmup, iters, sync)
        med = statistics.median(times)
        results[name] = {"step_s_median": med, "step_s_all": times, "tokens_per_s": tokens / med}
        if cuda:
            results[name]["peak_gpu_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        del model, step
        if cuda:
            torch.cuda.empty_cache()
    base = results["bare"]["step_s_median"]
    for name in results:
        results[name]["ratio_to_bare"] = results[name]["step_s_median"] / base
    return {"shape": shape, "device": str(device), "tokens_per_step": tokens, "iters": iters,
            "targets": {"zero2": 1.10, "zero3": 1.25}, "variants": results}
