"""The training loss: speculators' forward KL over the draft vocabulary, with its gradient made in one pass.

speculators' eager ``kl_div`` (``log_softmax`` of the draft logits, ``softmax`` of the target logits,
``kl_div``, ``sum``; all in float32) leaves autograd a chain of full ``[tokens, draft vocabulary]`` tensors to
walk back through: the casts, ``log_softmax``'s backward, ``kl_div``'s (``xlogy``) backward. Its fused kernel
does the same in one pass, but not on a CPU. :func:`kl_div` is that one pass in PyTorch: per block of rows it
computes ``log q`` and ``log p`` in float32, the per-position ``KL(p || q)``, and the gradient with respect to
the draft logits, ``softmax(draft) - p``, which is all the backward needs (times the upstream weight of each
position: mask, decay, mean). Same loss, same gradient, within float32 rounding (``tests/unit/drafter/test_loss.py``).

The target side is the same at every draft position: speculators hands each position a slice of one target
tensor (``targets[:, k:]``), so its log-probabilities are computed once per forward, for the whole tensor, and
sliced (:class:`_Targets`), instead of once per position.
"""

from __future__ import annotations

import torch

ROWS = 256  # rows per block: a block of float32 [ROWS, 8192] temporaries stays within a core's L2


def _log_probs(rows: torch.Tensor) -> torch.Tensor:
    """float32 ``log_softmax`` of ``[rows, vocab]`` logits, a block of rows at a time (no float32 copy of all)."""
    return torch.cat([torch.log_softmax(rows[i:i + ROWS].float(), dim=-1) for i in range(0, rows.shape[0], ROWS)])


class _Targets:
    """``log p`` and ``p`` of the last target tensor seen, whole: a slice of it (speculators' ``targets[:, k:]``
    at draft position k) is answered from them. The tensor itself is held, so its identity cannot be reused by
    another tensor while it is remembered, and its version counter too, so a tensor changed in place is read
    again."""

    def __init__(self) -> None:
        self.base: torch.Tensor | None = None
        self.version = -1
        self.log_p = self.p = torch.empty(0)

    def of(self, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(log p, p)`` of ``targets`` as ``[rows, vocab]`` float32."""
        vocab = targets.shape[-1]
        base = targets._base if targets._base is not None else targets  # noqa: SLF001  (a view's tensor)
        whole = base.dim() == 3 and targets.dim() == 3 and base.shape[0] == targets.shape[0] == 1 and \
            base.shape[2] == vocab and base.is_contiguous() and targets.is_contiguous() and \
            not base.is_inference()  # an inference tensor has no version counter to see a change by
        if not whole:
            log_p = _log_probs(targets.reshape(-1, vocab))
            return log_p, log_p.exp()
        if self.base is not base or self.version != base._version:  # noqa: SLF001  (in-place changes count)
            self.base, self.version = base, base._version  # noqa: SLF001
            self.log_p = _log_probs(base[0])
            self.p = self.log_p.exp()
        first = (targets.storage_offset() - base.storage_offset()) // vocab
        rows = slice(first, first + targets.shape[1])
        return self.log_p[rows], self.p[rows]


_targets = _Targets()


class _KLDiv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        vocab = logits.shape[-1]
        flat_logits = logits.reshape(-1, vocab)
        all_log_p, all_p = _targets.of(targets)
        rows = flat_logits.shape[0]
        out = torch.empty(rows, dtype=torch.float32, device=logits.device)
        grad = torch.empty(rows, vocab, dtype=torch.float32, device=logits.device) if ctx.needs_input_grad[0] \
            else None
        for start in range(0, rows, ROWS):
            block = slice(start, start + ROWS)
            log_q = torch.log_softmax(flat_logits[block].float(), dim=-1)
            log_p, p = all_log_p[block], all_p[block]
            out[block] = (p * (log_p - log_q)).sum(-1)
            if grad is not None:
                torch.sub(log_q.exp_(), p, out=grad[block])
        ctx.save_for_backward(grad if grad is not None else out.new_empty(0))
        ctx.shape, ctx.dtype = logits.shape, logits.dtype
        return out.view(logits.shape[:-1])

    @staticmethod
    def backward(ctx, upstream: torch.Tensor):  # type: ignore[override]
        (grad,) = ctx.saved_tensors
        weighted = grad.mul_(upstream.reshape(-1, 1).float())  # the saved gradient is used once
        return weighted.view(ctx.shape).to(ctx.dtype), None


def kl_div(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-position ``KL(softmax(targets) || softmax(logits))``, shape ``logits.shape[:-1]``, float32: the
    signature of speculators' loss functions (``loss_config`` maps a name to ``(fn, weight)``)."""
    return _KLDiv.apply(logits, targets)
