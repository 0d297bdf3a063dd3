"""Draft vocabularies: token frequencies -> ``d2t``/``t2d``, and moving ``lm_head`` rows between vocabularies.

``d2t[i]`` is an offset: draft row ``i`` predicts target token ``i + d2t[i]``; ``t2d`` marks the target
tokens that have a draft row. The build is speculators' own (top-N by frequency over loss-masked tokens,
ties by id, padded with the lowest ids when the data has fewer distinct tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution
from speculators.utils.loading import load_model_layers

from draftline.errors import DataError


def build_vocab(freqs: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d2t, t2d)`` from a [target_vocab] tensor of token counts."""
    counts = {int(i): int(c) for i, c in enumerate(freqs.tolist()) if c > 0}
    return build_vocab_mappings_from_distribution(counts, draft_vocab_size, int(freqs.numel()))


def draft_to_target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """The target token id of every draft row."""
    return torch.arange(d2t.numel(), dtype=torch.long) + d2t.to(torch.long)


@dataclass(frozen=True)
class VocabRemap:
    """How rows move from an old draft vocabulary to a new one."""

    new_rows_from_old: torch.Tensor  # [new_draft], old row index or -1 for a token the old vocab lacks
    kept: int
    added: int
    dropped: int


def plan_remap(old_d2t: torch.Tensor, new_d2t: torch.Tensor) -> VocabRemap:
    old_ids, new_ids = draft_to_target_ids(old_d2t), draft_to_target_ids(new_d2t)
    row_of = {int(t): r for r, t in enumerate(old_ids.tolist())}
    src = torch.tensor([row_of.get(int(t), -1) for t in new_ids.tolist()], dtype=torch.long)
    kept = int((src >= 0).sum())
    return VocabRemap(new_rows_from_old=src, kept=kept, added=int(new_ids.numel()) - kept,
                      dropped=int(old_ids.numel()) - kept)


def remap_lm_head(old_lm_head: torch.Tensor, remap: VocabRemap, new_d2t: torch.Tensor,
                  verifier_lm_head: torch.Tensor) -> torch.Tensor:
    """Rows for the new vocabulary: a kept token keeps its trained row; a new token starts from the
    verifier's ``lm_head`` row for it (``verifier_lm_head`` is the full [target_vocab, hidden] matrix)."""
    new_ids = draft_to_target_ids(new_d2t)
    out = verifier_lm_head[new_ids].to(old_lm_head.dtype).clone()
    keep = remap.new_rows_from_old >= 0
    out[keep] = old_lm_head[remap.new_rows_from_old[keep]]
    return out


def verifier_head(verifier: str) -> torch.Tensor:
    """The verifier's output head, [target_vocab, hidden]: ``lm_head.weight``, or, for a verifier that ties its
    embeddings (SmolLM2, Llama-3.2, Qwen2.5-small, Gemma: no ``lm_head.weight`` in the checkpoint), the input
    embeddings it is tied to. Raises :class:`DataError` when neither is there."""
    def load(name: str) -> torch.Tensor | None:
        try:
            return load_model_layers([name], verifier).get(name)
        except ValueError:  # speculators: "None of the requested tensor names were found in the index"
            return None

    head = load("lm_head.weight")
    if head is None:  # tied: the head is the embedding matrix (read only then: at Kimi-K2's size it is 2.3 GB)
        head = load("embed_tokens.weight")
    if head is None:
        raise DataError(f"verifier {verifier} has neither lm_head.weight nor embed_tokens.weight: vocab=rebuild "
                        "needs its output head to start new draft tokens from")
    return head
