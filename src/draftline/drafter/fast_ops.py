"""A PyTorch CPU kernel too slow for the drafter's step, swapped for an equal one while speculators runs.

``torch.argmax`` over a bfloat16 CPU tensor runs a scalar loop: 31 ms for a ``[1024, 8192]`` draft-vocabulary
tensor on one core of this project's CPU, where ``Tensor.max(dim)`` takes 5 ms and returns the same index (the
first maximal value, as both are documented to). speculators' forward takes nine such argmaxes a step (the
next draft's tokens, then the draft's and the target's choice in its metrics, per draft position): a fifth of a
training step on the CPU (``python -m benchmarks.run step-profile``). :func:`bf16_argmax_by_max` makes
``torch.argmax`` take ``max`` for a bfloat16 CPU tensor and a dimension, and only while the context is open;
every other call goes to PyTorch's own argmax.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_ARGMAX = torch.argmax


def _argmax(input: torch.Tensor, dim: int | None = None, keepdim: bool = False, *,  # noqa: A002
            out: torch.Tensor | None = None) -> torch.Tensor:
    if dim is not None and out is None and input.dtype == torch.bfloat16 and input.device.type == "cpu":
        return input.max(dim, keepdim=keepdim).indices
    return _ARGMAX(input, dim=dim, keepdim=keepdim, out=out)


@contextlib.contextmanager
def bf16_argmax_by_max() -> Iterator[None]:
    """``torch.argmax`` of a bfloat16 CPU tensor along a dimension computed by ``Tensor.max`` inside the block."""
    if torch.argmax is _argmax:  # nested: the outer block restores it
        yield
        return
    torch.argmax = _argmax
    try:
        yield
    finally:
        torch.argmax = _ARGMAX
