"""Measured acceptance on real vLLM that ``evaluate`` starts itself: the drafter it loaded, written in the
speculators format, served beside the verifier on a loopback vLLM (float32, ``draftline.serving``), its
acceptance read from vLLM's spec-decode counters; then a plain vLLM (no drafter) decodes the same prompts and
the outputs must be identical token for token (speculative decoding is lossless; in float32 vLLM was, on every
prompt tried here).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from draftline.console import say
from draftline.evaluation.chain import ChainResult


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
        say(f"starting vLLM (float32, loopback) with the drafter, k={k} ...")
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
    with VllmServer(ServeSpec(model=verifier_dir, max_model_len=max_len)) as plain:
        reference, _ = generate_all(plain.endpoint, plain.model, prompts, max_new_tokens=max_new_tokens,
                                    concurrency=concurrency, progress=progress, what="plain greedy on vLLM")
        plain.check_alive()
    return lossless_against(result, reference)
