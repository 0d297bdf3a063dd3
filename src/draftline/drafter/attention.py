"""``blockwise``: the draft attention finetune trains with on a CPU: speculators' masked attention computed one
packed sample at a time, and the draft positions' diagonal keys as the diagonals they are.

speculators packs a step's samples into one sequence and, at TTT step *t*, lets position *i* attend causally to
its own sample's step-0 keys and, in each of steps 1..t, to the key at position *i* alone (its mask: document and
causal, then one diagonal per step). With ``sdpa`` or ``eager`` that mask is dense: every step scores ``T x (t+1)
T`` pairs of a ``T``-token pack, of which only ``sum n_d^2 / 2 + t T`` can be attended (a pack of four samples:
about an eighth at t = 0, a twentieth at t = 2). ``blockwise`` reads the samples' spans off the same mask and, for
each sample, scores its causal block with one matmul and its diagonal keys with one row-wise product, then takes
one float32 softmax over both and the values they weigh: eager attention's arithmetic (scores in the model's
dtype, softmax in float32) on the pairs the mask allows, so what the drafter learns does not change (tested:
output and gradients equal ``sdpa``'s within float32 rounding in float32, bf16 rounding in bf16). A mask that is
not this shape (a speculators change, padding, a sliding window) is handed to transformers' ``sdpa`` whole.

Training only: decoding (:mod:`draftline.evaluation.proposer`) and every exported drafter use ``sdpa``, and
``_attn_implementation`` is not written into a saved config.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

NAME = "blockwise"
AUTO = "auto"  # finetune's default: ``blockwise`` on CPU ranks, ``sdpa`` on GPUs (speculators' flex attention is
# the faster choice there, and blockwise keeps each sample's scores, as eager does: memory a GPU run plans for)


def choose(impl: str, *, on_cpu: bool) -> str:
    """The draft attention a run trains with: ``impl``, or for ``auto`` ``blockwise`` on CPU ranks, ``sdpa`` on
    GPUs."""
    if impl != AUTO:
        return impl
    return NAME if on_cpu else "sdpa"


def spans(mask: torch.Tensor, steps: int) -> list[tuple[int, int]] | None:
    """``(start, end)`` of each packed sample, read off a boolean mask ``[T, steps T]`` (True: attended), or
    ``None`` when the mask is not speculators' TTT mask over contiguous samples: causal within each sample in the
    step-0 block, nothing across samples, and the identity in every later block."""
    t = mask.shape[0]
    starts = [0, *(torch.nonzero(~torch.diagonal(mask[:, :t], offset=-1)).flatten() + 1).tolist()]
    parts = list(zip(starts, [*starts[1:], t], strict=True))
    triangles = [(b - a) * (b - a + 1) // 2 for a, b in parts]
    # every sample's lower triangle attended, and nothing more: causal within samples, nothing across them
    if int(mask[:, :t].sum()) != sum(triangles) or \
            any(int(mask[a:b, a:b].tril().sum()) != n for (a, b), n in zip(parts, triangles, strict=True)):
        return None
    for s in range(1, steps):  # the identity: a sum of t with the whole diagonal attended
        block = mask[:, s * t:(s + 1) * t]
        if int(block.sum()) != t or not bool(torch.diagonal(block).all()):
            return None
    return parts


def _sample(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, t: int, a: int, b: int,
            scale: float) -> torch.Tensor:
    """The attention output ``[1, H, n, D]`` of positions ``a..b-1``: causal over their step-0 keys, plus each
    later step's key at the same position. ``key``/``value`` are ``[1, H, steps T, D]`` (heads repeated)."""
    n = b - a
    steps = key.shape[2] // t
    q = query[:, :, a:b]
    scores = torch.matmul(q, key[:, :, a:b].transpose(-1, -2)) * scale
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    if steps == 1:
        weights = scores.float().softmax(-1).to(q.dtype)
        return torch.matmul(weights, value[:, :, a:b])
    later = [slice(s * t + a, s * t + b) for s in range(1, steps)]
    diag_k = torch.stack([key[:, :, cols] for cols in later], dim=2)  # [1, H, steps-1, n, D]
    diag_v = torch.stack([value[:, :, cols] for cols in later], dim=2)
    diag = (q.unsqueeze(2) * diag_k).sum(-1).transpose(-1, -2) * scale  # [1, H, n, steps-1]
    weights = torch.cat([scores, diag], dim=-1).float().softmax(-1).to(q.dtype)
    out = torch.matmul(weights[..., :n], value[:, :, a:b])
    return out + (weights[..., n:].transpose(-1, -2).unsqueeze(-1) * diag_v).sum(2)


def blockwise_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                        **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: ``query`` [1, H, T, D], ``key``/``value`` [1, Hkv, steps T, D] (every
    TTT step's keys so far), ``attention_mask`` boolean [1, 1, T, steps T]; returns ``([1, T, H, D], None)``."""
    t = query.shape[2]
    parts = None
    if attention_mask is not None and attention_mask.dtype == torch.bool and query.shape[0] == 1 and not dropout \
            and key.shape[2] % t == 0:
        parts = spans(attention_mask[0, 0], key.shape[2] // t)
    if parts is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = torch.cat([_sample(query, key, value, t, a, b, scale) for a, b in parts], dim=2)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, blockwise_attention)
