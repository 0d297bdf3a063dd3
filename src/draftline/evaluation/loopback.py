"""Measured acceptance on real vLLM that ``evaluate`` starts itself: the drafter it loaded, written in the
form vLLM loads for its layer, served beside the verifier on a loopback vLLM (in the verifier's dtype,
:func:`draftline.serving.hf_model.vllm_dtype`), its acceptance read from vLLM's spec-decode counters; then a
plain vLLM (no drafter) decodes the same prompts and the outputs are compared token for token.

In float32 they must be identical (speculative decoding is lossless; vLLM was, on every prompt tried here). In
bf16 (an MLA verifier on a CPU; every GPU) batched verification computes the verifier's logits in another
order than plain decoding, and plain bf16 decoding is not even identical to itself under another batching; a
difference counts as a near tie, not a mismatch, where each server's token is among the other's top choices
there (:func:`draftline.evaluation.vllm_backend.lossless_against`). bf16 strays beyond that now and then by
itself, so the plain server also decodes the prompts one request at a time, and the speculative output may
differ beyond a near tie on as many prompts as that self-noise bounds (95%), no more.

With both servers up, the same prompts are decoded on each, alternating wave by wave, each wave started once
both servers are idle, for the speed the drafter buys (:mod:`draftline.evaluation.speed`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import tempfile
from functools import partial
from pathlib import Path

import torch

from draftline.console import say
from draftline.drafter.served import save_served
from draftline.evaluation.chain import ChainResult
from draftline.evaluation.speed import decode_side, measure_speed, pair
from draftline.evaluation.vllm_backend import differences, generate_all, lossless_against, measure_vllm
from draftline.serving.engine import ServeSpec, VllmServer, wait_idle

SELF_NOISE_PROMPTS = 64  # bf16: prompts decoded twice by the plain server to measure its own noise


def save_for_vllm(drafter, verifier_dir: str | Path, out: Path) -> Path:
    """``drafter`` (an ``Eagle3DraftModel``) as the directory vLLM loads for its layer."""
    return save_served(drafter, out, str(verifier_dir))


def measure_loopback(drafter, verifier_dir: str, prompts: list[list[int]], *, k: int, max_new_tokens: int,
                     concurrency: int, progress: bool, check_lossless: bool = True,
                     speed_at: list[int] | None = None, sweep: list[int] | None = None,
                     confidence: float = 0.95) -> ChainResult:
    """The drafted server, then the plain one: side by side on a CPU host (the speed compared wave by wave,
    alternating), one after the other where a GPU is there (a verifier that fills the node leaves no room for
    a second server: each side's waves are decoded while it is up, and paired afterwards). ``sweep``: the speed
    also at each of these k, a drafted server per k (``result.sweep``)."""
    others = [x for x in (sweep or []) if x != k] if speed_at else []
    max_len = max(len(p) for p in prompts) + max_new_tokens + max([k, *others]) + 8
    together = not torch.cuda.is_available()
    with tempfile.TemporaryDirectory(prefix="draftline-evaluate-vllm-") as tmp, contextlib.ExitStack() as stack:
        directory = save_for_vllm(drafter, verifier_dir, Path(tmp) / "drafter")
        spec = ServeSpec(model=verifier_dir, drafter=str(directory), k=k, max_model_len=max_len)
        say(f"starting vLLM ({spec.dtype}, loopback) with the drafter, k={k} ...")
        server = stack.enter_context(VllmServer(spec))
        say(f"vLLM up in {server.startup_s:.0f} s; measuring {len(prompts)} prompts x {max_new_tokens} tokens")
        result = measure_vllm(server.endpoint, server.model, prompts, max_new_tokens=max_new_tokens,
                              concurrency=concurrency, progress=progress, tops=spec.dtype != "float32")
        server.check_alive()
        say(f"vLLM measured acceptance length {result.acceptance_length:.3f} "
            f"({result.generated_tokens / max(result.seconds, 1e-9):.0f} tokens/s)")
        if not check_lossless and not speed_at:
            return result
        sides: dict[int, dict] = {}  # k -> its drafted side's waves, where the two servers cannot run together
        swept: dict[int, list] = {}  # k -> its speeds
        if not together:  # the GPU node holds one verifier at a time
            if speed_at:
                sides[k] = decode_side((server.endpoint, server.model), prompts, max_new_tokens=max_new_tokens,
                                       concurrencies=speed_at, progress=progress)
            server.stop()
            for other in others:
                with _drafted(spec, other) as extra:
                    sides[other] = decode_side((extra.endpoint, extra.model), prompts, max_new_tokens=max_new_tokens,
                                               concurrencies=speed_at or [], progress=progress)
        say("plain vLLM (no drafter)" + (" beside it" if together else "") + ", for the lossless check"
            + (" and the speed-up" if speed_at else "") + " ...")
        plain = stack.enter_context(VllmServer(ServeSpec(model=verifier_dir, max_model_len=max_len)))
        if speed_at and together:
            result.speeds = measure_speed((server.endpoint, server.model), (plain.endpoint, plain.model), prompts,
                                          max_new_tokens=max_new_tokens, concurrencies=speed_at, level=confidence,
                                          progress=progress, settle=partial(wait_idle, [server, plain]))
            server.check_alive()
            server.stop()  # its figures are in; the plain server stays up for any other k swept
            swept = {k: result.speeds}
            for other in others:
                with _drafted(spec, other) as extra:
                    swept[other] = measure_speed((extra.endpoint, extra.model), (plain.endpoint, plain.model),
                                                 prompts, max_new_tokens=max_new_tokens, concurrencies=speed_at,
                                                 level=confidence, progress=progress,
                                                 settle=partial(wait_idle, [extra, plain]))
        elif sides:
            plain_side = decode_side((plain.endpoint, plain.model), prompts, max_new_tokens=max_new_tokens,
                                     concurrencies=speed_at or [], progress=progress)
            paired = {kk: pair(side, plain_side, confidence) for kk, side in sides.items()}
            for speed in (sp for speeds in paired.values() for sp in speeds):
                speed.alternated = False
            result.speeds, swept = paired[k], paired
        result.sweep = swept if sweep else {}  # a sweep of k alone still says it was measured
        if check_lossless:
            result = _lossless(result, plain, prompts, max_new_tokens, concurrency, progress)
        plain.check_alive()
    return result


def _drafted(spec: ServeSpec, k: int) -> VllmServer:
    say(f"starting vLLM with the drafter at k={k}, for the speed sweep ...")
    return VllmServer(dataclasses.replace(spec, k=k))


def _lossless(result: ChainResult, plain, prompts, max_new_tokens: int, concurrency: int,
              progress: bool) -> ChainResult:
    exact = plain.spec.dtype == "float32"
    tops: list | None = None if exact else []
    reference, _ = generate_all(plain.endpoint, plain.model, prompts, max_new_tokens=max_new_tokens,
                                concurrency=concurrency, progress=progress, what="plain greedy on vLLM", tops=tops)
    allowed = 0
    if tops is not None:  # bf16: how far plain decoding strays from itself one request at a time
        allowed = _self_noise(plain, prompts, reference, tops, max_new_tokens=max_new_tokens, progress=progress)
    checked = lossless_against(result, reference, reference_tops=tops, allowed=allowed)
    checked.speeds, checked.sweep = result.speeds, result.sweep
    return checked


def _self_noise(plain, prompts: list[list[int]], reference: list[list[int]], tops: list, *, max_new_tokens: int,
                progress: bool) -> int:
    """The mismatches bf16 noise alone would explain among ``prompts``: the plain server decodes the first
    :data:`SELF_NOISE_PROMPTS` again one request at a time, the outputs that differ from its batched ones beyond
    a near tie are counted, and the count's upper 95% bound, as a rate, is scaled to all prompts."""
    n = min(len(prompts), SELF_NOISE_PROMPTS)
    again_tops: list = []
    again, _ = generate_all(plain.endpoint, plain.model, prompts[:n], max_new_tokens=max_new_tokens, concurrency=1,
                            progress=progress, what="plain greedy again, one at a time", tops=again_tops)
    beyond = len(differences(again, reference[:n], again_tops, tops[:n])[1])
    allowed = math.floor(binomial_upper(beyond, n) * len(prompts))
    say(f"bf16 noise: plain vLLM one request at a time differed from itself beyond a near tie on {beyond} of {n} "
        f"prompts; up to {allowed} of {len(prompts)} such differences are bf16's, not the drafter's")
    return allowed


def binomial_upper(k: int, n: int, level: float = 0.95) -> float:
    """The one-sided upper ``level`` (Clopper-Pearson) bound of a rate seen ``k`` times in ``n``."""
    if k >= n:
        return 1.0
    lo, hi = k / n, 1.0
    for _ in range(60):  # bisection: P(X <= k | n, p) falls as p grows
        mid = (lo + hi) / 2
        cdf = sum(math.comb(n, i) * mid ** i * (1 - mid) ** (n - i) for i in range(k + 1))
        lo, hi = (mid, hi) if cdf > 1 - level else (lo, mid)
    return hi
