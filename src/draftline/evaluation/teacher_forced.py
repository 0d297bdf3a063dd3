"""Teacher-forced metrics of a drafter on prepared samples, in one process: ``full_acc_k``, ``cond_acc_k`` and
the simulated acceptance length ``1 + sum_k prod_{j<=k} cond_acc_j`` (SpecForge's has no ``+1``), computed by
speculators' own forward in the pairing vLLM serves, exactly as finetune validates."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def measure(model, records: Sequence[dict[str, torch.Tensor]], *, ttt_steps: int, tokens_per_batch: int = 4096,
            progress: bool = False) -> dict[str, float]:
    from draftline.drafter.model import metric_sums, summarise

    dtype = next(p for p in model.parameters() if p.is_floating_point()).dtype
    return summarise(metric_sums(model, records, ttt_steps=ttt_steps, tokens_per_batch=tokens_per_batch,
                                 dtype=dtype, progress=progress), ttt_steps)


def prompts_of(records: Sequence[dict[str, torch.Tensor]]) -> list[list[int]]:
    """Each sample's prompt: its tokens before the first assistant (loss-masked) token. Samples whose first
    token is already an assistant token (nothing to prompt with) are left out."""
    out = []
    for r in records:
        mask = r["loss_mask"].bool()
        first = int(mask.nonzero()[0]) if mask.any() else int(mask.numel())
        if first > 0:
            out.append(r["input_ids"][:first].tolist())
    return out
