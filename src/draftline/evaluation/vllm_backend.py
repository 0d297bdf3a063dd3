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

from draftline.evaluation.chain import ChainResult, first_mismatch
from draftline.serving.client import auth_headers, complete_with_stats, read_counters, settled_counters


def generate_all(endpoint: str, model: str, prompts: list[list[int]], *, max_new_tokens: int,
                 concurrency: int = 8, timeout_s: float = 600.0, progress: bool = False,
                 what: str = "vLLM", stats: list | None = None,
                 margins: list | None = None) -> tuple[list[list[int]], float]:
    """Greedy completions of every prompt, ``concurrency`` in flight: ``(outputs in prompt order, seconds)``;
    each request's spec-decode statistics (or None) are appended to ``stats`` in prompt order, and with
    ``margins``, each output's per-token top-2 log-probability margins (:func:`complete_with_stats`)."""
    from tqdm import tqdm

    from draftline.console import bar_kwargs

    headers = auth_headers()
    start, tokens = time.perf_counter(), [0]
    with httpx.Client() as client, ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool, \
            tqdm(total=len(prompts), desc=f"[draftline] {what}", unit="prompt", **bar_kwargs(progress)) as bar:
        def one(prompt: list[int]) -> tuple[list[int], dict | None, list[float] | None]:
            top2: list[float] | None = [] if margins is not None else None
            out, spec = complete_with_stats(client, endpoint, model, prompt, max_tokens=max_new_tokens,
                                            headers=headers, timeout_s=timeout_s, margins=top2)
            tokens[0] += len(out)
            bar.update(1)
            bar.set_postfix_str(f"{tokens[0] / max(time.perf_counter() - start, 1e-9):.0f} tokens/s")
            return out, spec, top2
        done = list(pool.map(one, prompts))
    if stats is not None:
        stats.extend(spec for _, spec, _ in done)
    if margins is not None:
        margins.extend(top2 for _, _, top2 in done)
    return [out for out, _, _ in done], time.perf_counter() - start


def measure_vllm(endpoint: str, model: str, prompts: list[list[int]], *, max_new_tokens: int,
                 concurrency: int = 8, timeout_s: float = 600.0, progress: bool = False) -> ChainResult:
    """Greedy completions (``temperature=0``) of ``prompts`` (token ids) through ``POST <endpoint>/completions``,
    with ``concurrency`` requests in flight; acceptance from the server's spec-decode counters. The outputs are
    kept on the result (``outputs``) for a lossless check against a plain server."""
    headers = auth_headers()
    before = read_counters(endpoint, model, headers)
    stats: list[dict | None] = []
    outputs, seconds = generate_all(endpoint, model, prompts, max_new_tokens=max_new_tokens,
                                    concurrency=concurrency, timeout_s=timeout_s, progress=progress,
                                    what="measuring on vLLM", stats=stats)
    after = settled_counters(endpoint, model, headers)

    per_before, per_after = before["num_accepted_tokens_per_pos"], after["num_accepted_tokens_per_pos"]
    k = max(per_after) + 1 if per_after else 0
    delta = lambda name: int(round(after[name] - before[name]))  # noqa: E731
    return ChainResult(k=k, prompts=len(prompts), drafts=delta("num_drafts"),
                         draft_tokens=delta("num_draft_tokens"), accepted=delta("num_accepted_tokens"),
                         accepted_per_pos=[int(round(per_after.get(p, 0.0) - per_before.get(p, 0.0)))
                                           for p in range(k)],
                         generated_tokens=sum(len(o) for o in outputs), seconds=seconds, mismatches=[],
                         lossless_checked=False, backend="vllm", outputs=outputs,
                         per_prompt=per_prompt_rows(prompts, outputs, stats, k))


def per_prompt_rows(prompts, outputs, stats, k: int) -> list[dict]:
    """Per-prompt evidence from vLLM's per-request statistics (its acceptance histogram: steps that accepted j
    drafts); empty where the server reports none (``--per-request-spec-decode-metrics`` not set)."""
    from draftline.evaluation.chain import prompt_row

    if not stats or any(s is None for s in stats):
        return []
    rows = []
    for prompt, out, s in zip(prompts, outputs, stats, strict=True):
        hist = list(s.get("acceptance_histogram") or [])
        per_pos = [sum(hist[j] for j in range(i + 1, len(hist))) for i in range(k)]
        rows.append(prompt_row(prompt, int(s["num_spec_steps"]), int(s["num_accepted_draft_tokens"]), per_pos,
                               len(out)))
    return rows


def lossless_against(result: ChainResult, reference: list[list[int]], *, margins: list[list[float]] | None = None,
                     tolerance: float = 0.0) -> ChainResult:
    """Mark ``result`` lossless-checked against ``reference`` (the plain greedy outputs of the same prompts).

    A first differing token per prompt is a mismatch (``mismatches``: a bug), unless the plain server's own top-2
    log-probability margin at that position (``margins``) is within ``tolerance``: a near tie, which batched
    verification in bf16 may break either way (``near_ties``). With ``tolerance`` 0 (float32) every difference
    is a mismatch."""
    for i, (got, want) in enumerate(zip(result.outputs, reference, strict=True)):
        miss = first_mismatch(i, want, got)
        if miss is None:
            continue
        top2 = margins[i] if margins else []
        margin = top2[miss["position"]] if miss["position"] < len(top2) else None
        if margin is not None and margin <= tolerance:
            result.near_ties.append({**miss, "margin": round(margin, 4)})
        else:
            result.mismatches.append({**miss, **({"margin": round(margin, 4)} if margin is not None else {})})
    result.lossless_checked = True
    result.lossless_tolerance = tolerance
    return result
