"""Measured acceptance on real vLLM that ``evaluate`` starts itself: the drafter it loaded, written in the
speculators format, served beside the verifier on a loopback vLLM (in the verifier's dtype,
:func:`draftline.serving.hf_model.vllm_dtype`), its acceptance read from vLLM's spec-decode counters; then a
plain vLLM (no drafter) decodes the same prompts and the outputs are compared token for token.

In float32 they must be identical (speculative decoding is lossless; vLLM was, on every prompt tried here). In
bf16 (an MLA verifier on a CPU; every GPU) batched verification computes the verifier's logits in another
order than plain decoding, so where its first and second choice are nearly tied the two may pick differently:
a difference counts as a near tie, not a mismatch, where the plain server's own top-2 log-probability margin is
at most :data:`BF16_TIE_MARGIN`.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from draftline.console import say
from draftline.evaluation.chain import ChainResult

# log p(first) - log p(second) below which bf16 batched verification may choose the other token. Provisional:
# two bf16 computations of the same logits in another order differ less than bf16 does from float32, whose
# first-choice flips on the random Kimi-shaped miniature came at float32 margins up to 2.0 (p90 1.3, margin
# noise p50 0.07; benchmarks/results/capture-tiny+kimi.json); vLLM's batched-vs-plain bf16 itself is not yet
# measured here (a CPU without AMX cannot serve an MLA verifier beside a drafter: docs/kimi.md)
BF16_TIE_MARGIN = 0.25


def save_for_vllm(drafter, verifier_dir: str | Path, out: Path) -> Path:
    """``drafter`` (an ``Eagle3DraftModel``) as a speculators-format directory vLLM loads."""
    drafter.config.target_hidden_size = drafter.hidden_size
    drafter.config.speculators_config.verifier.name_or_path = str(verifier_dir)
    drafter.save_pretrained(str(out), safe_serialization=True)
    return out


def measure_loopback(drafter, verifier_dir: str, prompts: list[list[int]], *, k: int, max_new_tokens: int,
                     concurrency: int, progress: bool, check_lossless: bool = True) -> ChainResult:
    from draftline.evaluation.vllm_backend import generate_all, lossless_against, measure_vllm
    from draftline.serving.engine import ServeSpec, VllmServer

    max_len = max(len(p) for p in prompts) + max_new_tokens + k + 8
    with tempfile.TemporaryDirectory(prefix="draftline-evaluate-vllm-") as tmp:
        directory = save_for_vllm(drafter, verifier_dir, Path(tmp) / "drafter")
        spec = ServeSpec(model=verifier_dir, drafter=str(directory), k=k, max_model_len=max_len)
        say(f"starting vLLM ({spec.dtype}, loopback) with the drafter, k={k} ...")
        with VllmServer(spec) as server:
            say(f"vLLM up in {server.startup_s:.0f} s; measuring {len(prompts)} prompts x "
                f"{max_new_tokens} tokens")
            result = measure_vllm(server.endpoint, server.model, prompts, max_new_tokens=max_new_tokens,
                                  concurrency=concurrency, progress=progress)
            server.check_alive()
    say(f"vLLM measured acceptance length {result.acceptance_length:.3f} "
        f"({result.generated_tokens / max(result.seconds, 1e-9):.0f} tokens/s)")
    if not check_lossless:
        return result
    say("plain vLLM (no drafter) for the lossless check ...")
    plain_spec = ServeSpec(model=verifier_dir, max_model_len=max_len)
    exact = plain_spec.dtype == "float32"
    margins: list | None = None if exact else []
    with VllmServer(plain_spec) as plain:
        reference, _ = generate_all(plain.endpoint, plain.model, prompts, max_new_tokens=max_new_tokens,
                                    concurrency=concurrency, progress=progress, what="plain greedy on vLLM",
                                    margins=margins)
        plain.check_alive()
    return lossless_against(result, reference, margins=margins, tolerance=0.0 if exact else BF16_TIE_MARGIN)
