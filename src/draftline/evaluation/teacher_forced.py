"""Teacher-forced metrics of a drafter on prepared samples, in one process: ``full_acc_k``, ``cond_acc_k``, the
simulated acceptance length ``1 + sum_k prod_{j<=k} cond_acc_j`` (SpecForge's has no ``+1``) and vLLM's walk
over the same drafts (``walk_acceptance_length``, :mod:`draftline.drafter.walk`), computed by speculators' own
forward in the pairing vLLM serves, exactly as finetune validates.

:func:`served_samples` cuts the samples to what a measured evaluation serves (the first ``max_prompts``
prompts, the first ``max_new_tokens`` tokens of each first reply): the walk over those is the acceptance
length vLLM should report for them, when the replies are the verifier's own greedy output."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import torch

from draftline.drafter.model import metric_sums, summarise


def measure(model, records: Sequence[Mapping[str, torch.Tensor]], *, ttt_steps: int, tokens_per_batch: int = 4096,
            progress: bool = False) -> dict[str, float]:
    dtype = next(p for p in model.parameters() if p.is_floating_point()).dtype
    return summarise(metric_sums(model, records, ttt_steps=ttt_steps, tokens_per_batch=tokens_per_batch,
                                 dtype=dtype, progress=progress), ttt_steps)


def _prompted(records: Sequence[Mapping[str, torch.Tensor]]):
    """``(record, first)`` for each sample with a prompt, ``first`` being its first assistant (loss-masked)
    token (its length when it has none). Samples that start with an assistant token are left out."""
    for r in records:
        mask = r["loss_mask"].bool()
        first = int(mask.nonzero()[0]) if mask.any() else int(mask.numel())
        if first > 0:
            yield r, first


def prompts_of(records: Sequence[Mapping[str, torch.Tensor]]) -> list[list[int]]:
    """Each sample's prompt: its tokens before the first assistant (loss-masked) token. Samples whose first
    token is already an assistant token (nothing to prompt with) are left out."""
    return [r["input_ids"][:first].tolist() for r, first in _prompted(records)]


def served_samples(records: Sequence[Mapping[str, torch.Tensor]], max_prompts: int | None, max_new_tokens: int,
                   outputs: Sequence[Sequence[int]] | None = None) -> list[tuple[int, dict[str, torch.Tensor]]]:
    """``(prompt index, sample)`` for :func:`prompts_of`'s first ``max_prompts`` prompts, each cut after the first
    ``max_new_tokens`` tokens of its first reply: the tokens a measured evaluation asks the server for. With
    ``outputs`` (what the measurement
    generated, in prompt order) only the samples whose cut reply is, token for token, what was served: a reply
    the data holds but the server did not produce (prepare fell back to re-tokenising lossy reply text, or bf16
    took another branch) says nothing about what was measured on that prompt."""
    out = []
    for j, (r, first) in enumerate(itertools.islice(_prompted(records), max_prompts)):
        reply = r["loss_mask"][first:first + max_new_tokens].bool()
        length = int(reply.numel()) if bool(reply.all()) else int((~reply).nonzero()[0])  # up to the turn's end
        if not length:
            continue
        if outputs is not None and (j >= len(outputs) or
                                    r["input_ids"][first:first + length].tolist() != list(outputs[j][:length])):
            continue
        out.append((j, {k: v[:first + length] for k, v in r.items()}))
    return out


def greedy_replies(manifest: dict) -> bool:
    """Whether the samples' replies are the verifier's own greedy output (prepare regenerated them at
    temperature 0): only then does the walk over them predict what serving measures."""
    regenerated = manifest.get("regenerated") or {}
    return bool(regenerated) and float(regenerated.get("temperature", 1.0)) == 0.0
