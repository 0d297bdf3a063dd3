"""Hidden states stored in 8 bits: OCP FP8 E4M3 (``torch.float8_e4m3fn``, what safetensors writes as ``F8_E4M3``)
with one float32 scale per token and layer, read back to bf16.

Each row (one token's hidden state of one captured layer, H values) is scaled so its largest magnitude lands on
E4M3's largest finite value (448) and rounded to E4M3: 3 mantissa bits, a relative error within 2^-4 for every
value, the row's own range kept whatever the layer's (hidden states of a late layer run hundreds of times larger
than an early one's, and single outlier channels dominate a row: a scale per row keeps the rest from underflowing
beside them, where one per tensor would not). A token of Kimi-K2.5 then costs (aux + 1) x (7168 + 4) bytes instead
of (aux + 1) x 7168 x 2: 0.50x. E4M3, not E5M2: hidden states need precision more than range once each row is
scaled, as in the FP8 KV caches vLLM serves.
"""

from __future__ import annotations

import torch

__all__ = ["E4M3", "SCALE_SUFFIX", "dequantize", "quantize"]

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448
SCALE_SUFFIX = "_scale"  # "hidden_states" is stored beside "hidden_states_scale"


def quantize(x: torch.Tensor, hidden_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [T, G*hidden_size] -> (E4M3 [T, G*hidden_size], float32 scales [T, G])."""
    rows = x.detach().reshape(x.shape[0], -1, hidden_size).float()
    scale = rows.abs().amax(dim=-1).clamp(min=1e-12) / E4M3_MAX
    q = (rows / scale.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q.reshape(x.shape[0], -1), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The inverse of :func:`quantize`, in ``dtype``: [T, G*H] from [T, G*H] E4M3 and [T, G] scales."""
    rows = q.reshape(q.shape[0], scale.shape[1], -1).float() * scale.unsqueeze(-1)
    return rows.to(dtype).reshape(q.shape[0], -1)
