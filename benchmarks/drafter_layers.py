"""drafter-layers: a training step of the Llama-layer drafter against the MLA-layer one, on the same verifier
shape, each with the blockwise draft attention and with sdpa, interleaved in one run.

``--shape kimi`` is the Kimi-shaped miniature (``draftline make-tiny --family kimi``: hidden 256, 4 heads,
DeepSeek's MLA head dims, vocabulary 527, draft vocabulary 256); ``real`` is AQ-MedAI's Kimi-K2 Llama layer
against lightseek's Kimi-K2.5 MLA layer at a 32,000-token draft vocabulary (a GPU job). Same packed batch
(shifted into vLLM's pairing), same seed, bf16, a bare AdamW step (forward, backward, clip, step), one rank.
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks.common import bench_model, fake_batch

PAIRS = {"kimi": ("tiny-kimi", "tiny-kimi-mla"), "real": ("real", "real-mla")}


def adamw_step(model, batch, cfg):
    from draftline.drafter.model import forward, trainable_parameters

    params = trainable_parameters(model)
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95))

    def step():
        loss, _ = forward(model, batch, 3, cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
    return step


def interleaved(steps: dict, *, iters: int, rounds: int, sync) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """``rounds`` rounds of ``iters`` calls of each step, the order rotated each round: ``(every step's seconds,
    each round's median)`` by name."""
    names = list(steps)
    times: dict[str, list[float]] = {n: [] for n in names}
    medians: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t = []
            for _ in range(iters):
                t0 = time.perf_counter()
                steps[name]()
                sync()
                t.append(time.perf_counter() - t0)
            times[name] += t
            medians[name].append(statistics.median(t))
    return times, medians


def run(shape: str = "kimi", tokens: int = 512, iters: int = 6, rounds: int = 5) -> dict:
    """Every variant is built first; then ``rounds`` rounds of ``iters`` steps of each, the order rotated each
    round. Each round gives each variant's median step over ``llama@blockwise``'s in that round; the result is
    the median ratio and its spread over rounds."""
    from draftline.drafter.model import loss_config

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    llama, mla = PAIRS[shape]
    variants = {f"{layer}@{attn}": (name, attn) for layer, name in (("llama", llama), ("mla", mla))
                for attn in ("blockwise", "sdpa")}
    steps, params = {}, {}
    for key, (name, attn) in variants.items():
        torch.manual_seed(0)
        model = bench_model(name, device, attn=attn)
        params[key] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        steps[key] = adamw_step(model, fake_batch(model, tokens, device), loss_config())
        steps[key]()  # warm-up
        sync()
    names = list(variants)
    times, medians = interleaved(steps, iters=iters, rounds=rounds, sync=sync)
    ratios = {n: [m / b for m, b in zip(medians[n], medians["llama@blockwise"], strict=True)] for n in names}
    results = {n: {"trainable_params": params[n], "step_s_median": statistics.median(times[n]),
                   "tokens_per_s": tokens / statistics.median(times[n]), "step_s_all": times[n],
                   "ratio_to_llama_blockwise": statistics.median(ratios[n]), "ratio_per_round": ratios[n],
                   "ratio_spread": [min(ratios[n]), max(ratios[n])]} for n in names}
    summary = {n: f"x{r['ratio_to_llama_blockwise']:.2f} [{r['ratio_spread'][0]:.2f}, {r['ratio_spread'][1]:.2f}] "
                  f"step time vs llama@blockwise; {r['tokens_per_s']:.0f} tokens/s" for n, r in results.items()}
    for layer in ("llama", "mla"):  # blockwise against sdpa on the same layer, per round
        per = [s / b for s, b in zip(ratios[f"{layer}@sdpa"], ratios[f"{layer}@blockwise"], strict=True)]
        summary[f"{layer}: blockwise speed-up over sdpa"] = (f"x{statistics.median(per):.2f} "
                                                             f"[{min(per):.2f}, {max(per):.2f}] per round")
    return {"summary": summary, "shape": shape, "layers": {"llama": llama, "mla": mla}, "device": str(device),
            "dtype": "bfloat16", "tokens_per_step": tokens, "iters": iters, "rounds": rounds,
            "method": "variants interleaved, order rotated each round; ratio = median over rounds of the round's "
                      "median step / llama@blockwise's; spread = min..max over rounds",
            "steps": results}
