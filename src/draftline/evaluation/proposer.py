"""The drafter side of greedy chain speculative decoding, as vLLM's EAGLE-3 proposer runs it, on speculators'
``Eagle3DraftModel``.

vLLM references (``vllm/v1/spec_decode/eagle.py``, ``EagleProposer.propose``;
``vllm/model_executor/models/llama_eagle3.py``):

- *step 0* runs over every newly verified position ``t`` with the verifier's aux hidden states, combined once by
  ``fc`` (``combine_hidden_states``), and the input ids shifted by one (``input_ids[:n-1] = target_token_ids[1:]``,
  the last one replaced by the token the verifier just sampled): hidden state at ``t`` with token ``t+1``. The
  output at the last position gives draft 1 (``compute_logits``: ``lm_head`` over the draft vocabulary, then
  ``draft id + d2t[draft id]`` is the verifier's id).
- *each later step* feeds the previous draft with the drafter's own output hidden state at that position: the
  second value ``LlamaModel.forward`` returns, ``hidden_prenorm`` (the residual stream after the decoder layer,
  before ``norm``; not through ``fc`` again), at the next position, attending to all earlier positions.
- the drafter's KV cache keeps the step-0 entries of verified positions across rounds; a later round's step 0
  overwrites the slots of the previous round's drafts (here: the cache is cropped back to the verified
  positions after each round, which is the same thing).

Positions: vLLM gives position ``t`` to the pair (hidden ``t``, token ``t+1``); speculators trains it at ``t+1``
(``shift_batch``: positions start at 1). We use ``t+1``, as training did; RoPE sees only position differences,
so the two agree up to rounding.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

SUPPORTED_ATTENTION = ("sdpa", "eager")


def truncate(cache, length: int) -> None:
    """Cut a ``DynamicCache`` back to its first ``length`` positions (a negative ``crop`` removes that many)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


class Eagle3Proposer:
    """Greedy chain drafts for one sequence at a time; :meth:`reset` before each new prompt."""

    def __init__(self, drafter):
        impl = drafter.config.transformer_layer_config._attn_implementation  # noqa: SLF001
        if impl not in SUPPORTED_ATTENTION:
            raise TypeError(f"the drafter uses {impl!r} attention; build it with attn_impl='sdpa' (or 'eager') "
                            "to decode with it")
        self.model = drafter
        self.aux_layer_ids = list(drafter.config.eagle_aux_hidden_state_layer_ids)
        self.dtype = drafter.fc.weight.dtype
        self.device = drafter.fc.weight.device
        self.reset()

    def reset(self) -> None:
        self.cache = DynamicCache()
        self.verified = 0  # step-0 positions in the cache (verified pairs so far)

    def _layers(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """Run the decoder layers on ``x`` [1, n, 2H] at cache slots ``start..start+n-1`` (positions +1),
        attending to every cached slot before and causally within ``x``; returns the pre-norm output."""
        m = self.model
        n = x.shape[1]
        cache_position = torch.arange(start, start + n, device=self.device)
        position_ids = (cache_position + 1).unsqueeze(0)
        keys = torch.arange(start + n, device=self.device)
        allowed = keys.unsqueeze(0) <= cache_position.unsqueeze(1)  # [n, start+n]
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        mask = mask.masked_fill(~allowed, torch.finfo(self.dtype).min)[None, None]
        position_embeddings = m.rotary_emb(x, position_ids)
        for layer in m.layers:
            x = layer(x, attention_mask=mask, position_ids=position_ids, past_key_values=self.cache,
                      cache_position=cache_position, position_embeddings=position_embeddings)
        return x

    def _next(self, h: torch.Tensor) -> tuple[int, torch.Tensor]:
        """The greedy draft (a verifier token id) from the pre-norm output ``h`` [H], and the hidden state the
        next step is fed (speculators' ``forward``: pre-norm unless the config sets ``norm_output``)."""
        m = self.model
        if m.config.norm_output:
            h = m.norm(h)
            logits = m.lm_head(h)
        else:
            logits = m.lm_head(m.norm(h))
        draft = int(torch.argmax(logits))
        if m.d2t is not None:
            draft += int(m.d2t[draft])
        return draft, h

    def _combine(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """``fc`` over the concatenated aux hidden states (with the optional input norms speculators applies)."""
        m = self.model
        h = aux_hidden.to(device=self.device, dtype=self.dtype)
        if m.input_norm is not None:
            h = m.input_norm(h)
        if m.fc_norm is not None:
            h = torch.cat([norm(c) for norm, c in zip(m.fc_norm, h.chunk(len(m.fc_norm), dim=-1), strict=True)],
                          dim=-1)
        return m.fc(h)

    @torch.inference_mode()
    def propose(self, aux_hidden: torch.Tensor, next_tokens: list[int], num_drafts: int,
                feed: list[int] | None = None) -> list[int]:
        """Add the newly verified pairs and draft ``num_drafts`` tokens after them.

        ``aux_hidden`` [n, aux*H]: the verifier's aux hidden states of the newly verified positions ``t``;
        ``next_tokens``: the token at ``t+1`` for each (the last one is the token the verifier just sampled).
        ``feed`` replaces the drafts fed to the later steps (teacher forcing, as speculators trains; decoding
        feeds the drafts themselves).
        """
        m = self.model
        n = len(next_tokens)
        if aux_hidden.shape[0] != n:
            raise ValueError(f"{aux_hidden.shape[0]} hidden states for {n} tokens")
        truncate(self.cache, self.verified)  # forget the previous round's drafts
        ids = torch.tensor([next_tokens], device=self.device)
        x = torch.cat([m.embed_tokens(ids), self._combine(aux_hidden).unsqueeze(0)], dim=-1)
        out = self._layers(x, self.verified)
        self.verified += n
        drafts: list[int] = []
        draft, h = self._next(out[0, -1])
        drafts.append(draft)
        for step in range(1, num_drafts):
            ids = torch.tensor([[draft if feed is None else feed[step - 1]]], device=self.device)
            x = torch.cat([m.embed_tokens(ids), h.view(1, 1, -1)], dim=-1)
            out = self._layers(x, self.verified + step - 1)
            draft, h = self._next(out[0, -1])
            drafts.append(draft)
        return drafts
