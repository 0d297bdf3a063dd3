"""The acceptance length vLLM's own walk would report, read off one teacher-forced forward.

Teacher-forced acceptance (``1 + sum_k prod_{j<=k} cond_acc_j``) averages the chain length over *every* reply
position. vLLM visits only some of them: a draft starts right after the last token the verifier emitted, so
after a chain of ``a`` accepted drafts it jumps ``a + 1`` tokens and the positions in between are never the
start of a draft. Easy stretches (long chains) are skipped over, hard ones (chains of 0) visited one by one, so
the uniform average sits above what vLLM serves, and the more so the better the drafter is on the easy
stretches (on the real tier's full child, 2.03 against 1.81 served).

:func:`walk_sums` replays that walk over each reply of a packed batch: at position ``i`` the draft of step
``k`` (mapped to the verifier's vocabulary through ``d2t``) is right when it equals the data's own token
``i + k + 1`` — the verifier's greedy token when prepare regenerated the replies at temperature 0, its default
— so a draft outside the draft vocabulary's argmax never counts, as in vLLM. The sums all-reduce like
speculators' metrics; :func:`draftline.drafter.model.summarise` turns them into ``walk_acceptance_length``
(``1 + accepted / drafts``, vLLM's definition) and the per-position rates ``walk_pos_k``.
"""

from __future__ import annotations

import torch


def chain_lengths(draft_tokens, batch: dict[str, torch.Tensor], d2t: torch.Tensor | None, ttt_steps: int) -> torch.Tensor:
    """``[T]``: how many of the drafts made at each packed position the verifier would accept in a row."""
    ids, mask, doc = batch["input_ids"][0], batch["loss_mask"][0].bool(), batch["document_ids"][0]
    total = ids.numel()
    index = torch.arange(total, device=ids.device)
    run = torch.ones(total, dtype=torch.bool, device=ids.device)
    accepted = torch.zeros(total, dtype=torch.long, device=ids.device)
    for k, drafts in enumerate(draft_tokens[:ttt_steps]):
        drafted = drafts[0].long()
        if d2t is not None:  # d2t holds offsets: verifier id = draft id + d2t (None: the whole vocabulary)
            drafted = drafted + d2t.to(drafted.device)[drafted]
        target = (index + k + 1).clamp(max=total - 1)
        run &= (index + k + 1 < total) & (drafted == ids[target]) & (doc[target] == doc) & mask[target]
        accepted += run.long()
    return accepted


def walk_sums(draft_tokens, batch: dict[str, torch.Tensor], d2t: torch.Tensor | None,
              ttt_steps: int) -> dict[str, torch.Tensor]:
    """``walk_accepted`` and ``walk_pos_k`` as ``*_sum`` / ``*_total`` pairs (totals: the drafts made) over
    every contiguous reply (run of loss-masked positions) in ``batch``, walked as vLLM does. Each reply is
    walked as if it stopped at max_tokens (drafts trimmed near its end, as the evaluations serve them); one
    that ends in EOS would differ only in its last ``ttt_steps`` tokens."""
    accepted = chain_lengths(draft_tokens, batch, d2t, ttt_steps).tolist()
    mask = batch["loss_mask"][0].bool().tolist()
    doc = batch["document_ids"][0].tolist()
    drafts, total, per_pos = 0, 0, [0] * ttt_steps
    i, n = 0, len(mask)
    while i < n:
        if not mask[i]:
            i += 1
            continue
        end = i  # the reply's last token: no draft is made from it
        while end + 1 < n and mask[end + 1] and doc[end + 1] == doc[i]:
            end += 1
        while i < end:
            spec = min(ttt_steps, end - i - 1)  # vLLM trims the drafts that would pass max_tokens
            if spec == 0:  # one token left: a plain decode step, no draft counted
                i += 1
                continue
            a = min(accepted[i], spec)
            drafts += 1
            total += a
            for k in range(a):
                per_pos[k] += 1
            i += a + 1
        i = end + 1
    d = torch.tensor(float(drafts))
    out = {"walk_accepted_sum": torch.tensor(float(total)), "walk_accepted_total": d}
    for k, hits in enumerate(per_pos):
        out[f"walk_pos_{k}_sum"], out[f"walk_pos_{k}_total"] = torch.tensor(float(hits)), d.clone()
    return out
