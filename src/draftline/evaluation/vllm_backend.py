"""Measured acceptance from a vLLM server: greedy completions of token-id prompts, read from vLLM's
spec-decode Prometheus counters before and after (``draftline.serving.client``).

The verifier's own greedy output is not visible on a speculative server, so the lossless check needs a second,
plain server: :func:`lossless_against` compares the outputs with its greedy outputs, token for token (the
loopback backend of ``evaluate`` does that; against a server the user runs, ``lossless_checked`` is False).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from tqdm import tqdm

from draftline.console import bar_kwargs
from draftline.evaluation.chain import ChainResult, first_mismatch, prompt_row
from draftline.serving.client import TOP_LOGPROBS, auth_headers, complete_with_stats, read_counters, settled_counters


def generate_all(endpoint: str, model: str, prompts: list[list[int]], *, max_new_tokens: int,
                 concurrency: int = 8, timeout_s: float = 600.0, progress: bool = False,
                 what: str = "vLLM", stats: list | None = None,
                 tops: list | None = None) -> tuple[list[list[int]], float]:
    """Greedy completions of every prompt, ``concurrency`` in flight: ``(outputs in prompt order, seconds)``;
    each request's spec-decode statistics (or None) are appended to ``stats`` in prompt order, and with
    ``tops``, each output's per-token top choices and their log-probabilities (:func:`complete_with_stats`)."""
    headers = auth_headers()
    start, tokens = time.perf_counter(), [0]
    with httpx.Client() as client, ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool, \
            tqdm(total=len(prompts), desc=f"[draftline] {what}", unit="prompt", **bar_kwargs(progress)) as bar:
        def one(prompt: list[int]) -> tuple[list[int], dict | None, list[dict[int, float]] | None]:
            top2: list[dict[int, float]] | None = [] if tops is not None else None
            out, spec = complete_with_stats(client, endpoint, model, prompt, max_tokens=max_new_tokens,
                                            headers=headers, timeout_s=timeout_s, tops=top2)
            tokens[0] += len(out)
            bar.update(1)
            bar.set_postfix_str(f"{tokens[0] / max(time.perf_counter() - start, 1e-9):.0f} tokens/s")
            return out, spec, top2
        done = list(pool.map(one, prompts))
    if stats is not None:
        stats.extend(spec for _, spec, _ in done)
    if tops is not None:
        tops.extend(top2 for _, _, top2 in done)
    return [out for out, _, _ in done], time.perf_counter() - start


def measure_vllm(endpoint: str, model: str, prompts: list[list[int]], *, max_new_tokens: int,
                 concurrency: int = 8, timeout_s: float = 600.0, progress: bool = False,
                 tops: bool = False) -> ChainResult:
    """Greedy completions (``temperature=0``) of ``prompts`` (token ids) through ``POST <endpoint>/completions``,
    with ``concurrency`` requests in flight; acceptance from the server's spec-decode counters. The outputs are
    kept on the result (``outputs``, with ``tops`` their top-2 choices: ``output_tops``) for a lossless check
    against a plain server."""
    headers = auth_headers()
    before = read_counters(endpoint, model, headers)
    stats: list[dict | None] = []
    top2: list | None = [] if tops else None
    outputs, seconds = generate_all(endpoint, model, prompts, max_new_tokens=max_new_tokens,
                                    concurrency=concurrency, timeout_s=timeout_s, progress=progress,
                                    what="measuring on vLLM", stats=stats, tops=top2)
    after = settled_counters(endpoint, model, headers)

    per_before, per_after = before["num_accepted_tokens_per_pos"], after["num_accepted_tokens_per_pos"]
    k = max(per_after) + 1 if per_after else 0
    delta = lambda name: int(round(after[name] - before[name]))  # noqa: E731
    return ChainResult(k=k, prompts=len(prompts), drafts=delta("num_drafts"),
                         draft_tokens=delta("num_draft_tokens"), accepted=delta("num_accepted_tokens"),
                         accepted_per_pos=[int(round(per_after.get(p, 0.0) - per_before.get(p, 0.0)))
                                           for p in range(k)],
                         generated_tokens=sum(len(o) for o in outputs), seconds=seconds, mismatches=[],
                         lossless_checked=False, backend="vllm", outputs=outputs, output_tops=top2 or [],
                         per_prompt=per_prompt_rows(prompts, outputs, stats, k))


def per_prompt_rows(prompts, outputs, stats, k: int) -> list[dict]:
    """Per-prompt evidence from vLLM's per-request statistics (its acceptance histogram: steps that accepted j
    drafts); empty where the server reports none (``--per-request-spec-decode-metrics`` not set)."""
    if not stats or any(s is None for s in stats):
        return []
    rows = []
    for prompt, out, s in zip(prompts, outputs, stats, strict=True):
        hist = list(s.get("acceptance_histogram") or [])
        per_pos = [sum(hist[j] for j in range(i + 1, len(hist))) for i in range(k)]
        rows.append(prompt_row(prompt, int(s["num_spec_steps"]), int(s["num_accepted_draft_tokens"]), per_pos,
                               len(out)))
    return rows


def lossless_against(result: ChainResult, reference: list[list[int]], *,
                     reference_tops: list[list[dict[int, float]]] | None = None, allowed: int = 0) -> ChainResult:
    """Mark ``result`` lossless-checked against ``reference`` (the plain greedy outputs of the same prompts).

    Without ``reference_tops`` (float32) a first differing token per prompt is a mismatch (``mismatches``). With
    them (bf16) a difference is a near tie (``near_ties``) where, at that position, each server's token is among
    the other's top choices (``reference_tops``, ``result.output_tops``: :data:`TOP_LOGPROBS` each), the rule
    vLLM's own tests apply to bf16 outputs (``check_logprobs_close``); otherwise a mismatch. bf16 decoding
    differs from itself under another batching, now and then beyond that rule too: on the Kimi-shaped miniature
    a plain server, one request at a time against 8 in flight, differed on 45 of 64 prompts, 42 of them near
    ties (``benchmarks/results/bf16-ties-kimi.json``). So up to ``allowed`` mismatches (the self-noise
    :func:`draftline.evaluation.loopback.measure_loopback` measured) leave the result lossless."""
    near_ties, mismatches = differences(result.outputs, reference, result.output_tops, reference_tops)
    result.near_ties.extend(near_ties)
    result.mismatches.extend(mismatches)
    result.lossless_checked = True
    result.allowed_mismatches = allowed
    result.lossless_rule = f"top-{TOP_LOGPROBS}" if reference_tops is not None else "identical"
    return result


def differences(outputs: list[list[int]], reference: list[list[int]], output_tops: list | None,
                reference_tops: list | None) -> tuple[list[dict], list[dict]]:
    """Each prompt's first difference between ``outputs`` and ``reference``: ``(near ties, mismatches)``, a near
    tie only where both top-choice lists are given and each side's token is in the other's at that position."""
    near_ties, mismatches = [], []
    for i, (got, want) in enumerate(zip(outputs, reference, strict=True)):
        miss = first_mismatch(i, want, got)
        if miss is None:
            continue
        p = miss["position"]
        theirs, ours = _at(reference_tops, i, p), _at(output_tops, i, p)
        if reference_tops is not None and miss["got"] in theirs and miss["expected"] in ours:
            near_ties.append({**miss, "margin": round(_margin(theirs), 4)})
        else:
            mismatches.append(miss)
    return near_ties, mismatches


def _at(tops: list | None, i: int, p: int) -> dict[int, float]:
    return tops[i][p] if tops and i < len(tops) and p < len(tops[i]) else {}


def _margin(top: dict[int, float]) -> float:
    values = sorted(top.values(), reverse=True)
    return values[0] - values[1] if len(values) > 1 else float("inf")
