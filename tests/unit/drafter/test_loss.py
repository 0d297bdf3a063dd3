"""The one-pass KL loss is speculators' eager KL: same per-position loss, same gradient, within float32 rounding,
through speculators' own masking, decay and mean (``compound_loss``)."""

import pytest
import torch
from speculators.losses import resolve_loss_config
from speculators.losses.utils import compound_loss

from draftline.drafter.loss import ROWS, kl_div


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loss_and_gradient_equal_speculators_eager_kl(dtype):
    torch.manual_seed(0)
    tokens, vocab = ROWS * 2 + 37, 1000  # more than one block of rows, the last one partial
    logits = (torch.randn(1, tokens, vocab) * 3).to(dtype)
    targets = (torch.randn(1, tokens, vocab) * 3).to(dtype)
    mask = torch.rand(1, tokens) > 0.3
    pos = torch.full((1, tokens), 1)
    decay = lambda pos_idx, elementwise_loss: 0.8 ** pos_idx  # noqa: E731

    results = []
    for config in (resolve_loss_config("kl_div", "eager"), {"kl_div": (kl_div, 1.0)}):
        x = logits.clone().requires_grad_(True)
        loss, _ = compound_loss(x, targets, mask, pos, loss_config=config, decay_fn=decay)
        loss.backward()
        results.append((loss.detach(), x.grad))
    (want, want_grad), (got, got_grad) = results
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert got_grad.dtype == dtype
    torch.testing.assert_close(got_grad.float(), want_grad.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                               atol=1e-8)
    assert got_grad[~mask].abs().max() == 0  # masked positions get no gradient


def test_without_a_gradient_nothing_is_kept_and_the_loss_is_the_same():
    logits, targets = torch.randn(3, 50, 64), torch.randn(3, 50, 64)
    with torch.no_grad():
        got = kl_div(logits, targets)
    want = torch.nn.functional.kl_div(torch.log_softmax(logits, -1), torch.softmax(targets, -1),
                                      reduction="none").sum(-1)
    assert got.shape == (3, 50)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_each_draft_positions_slice_of_the_targets_is_answered_right_and_a_changed_tensor_is_read_again():
    """speculators gives draft position k ``targets[:, k:]`` of one tensor; the target side is computed once for
    the whole tensor and sliced, and a tensor changed in place (or a new one) is computed afresh."""
    torch.manual_seed(1)
    logits, targets = torch.randn(1, 300, 50), torch.randn(1, 300, 50)

    def reference(lg, tg):
        return torch.nn.functional.kl_div(torch.log_softmax(lg, -1), torch.softmax(tg, -1), reduction="none").sum(-1)

    for k in (0, 1, 2):
        torch.testing.assert_close(kl_div(logits[:, :300 - k], targets[:, k:]),
                                   reference(logits[:, :300 - k], targets[:, k:]), rtol=1e-5, atol=1e-6)
    targets.mul_(2)
    torch.testing.assert_close(kl_div(logits[:, :299], targets[:, 1:]), reference(logits[:, :299], targets[:, 1:]),
                               rtol=1e-5, atol=1e-6)
    other = torch.randn(1, 300, 50)
    torch.testing.assert_close(kl_div(logits, other), reference(logits, other), rtol=1e-5, atol=1e-6)


def test_argmax_of_bf16_by_max_gives_pytorchs_first_index_and_leaves_argmax_as_it_was():
    from draftline.drafter.fast_ops import bf16_argmax_by_max

    torch.manual_seed(2)
    x = torch.randn(1, 300, 257).to(torch.bfloat16)
    x[0, :, 5] = x[0, :, 200] = 100  # ties: the first maximal index, as argmax gives it
    x[0, 7] = 0  # a row all ties
    want = torch.argmax(x, dim=-1)
    original = torch.argmax
    with bf16_argmax_by_max():
        assert torch.argmax is not original
        got, got_keep = torch.argmax(x, dim=-1), torch.argmax(x, dim=-1, keepdim=True)
        floats = torch.argmax(x.float(), dim=-1)
    assert torch.argmax is original
    assert torch.equal(got, want) and torch.equal(got_keep.squeeze(-1), want) and torch.equal(floats, want)
    assert got[0, 0] == 5 and got[0, 7] == 0


def test_under_inference_mode_the_loss_is_computed_each_time():
    logits, targets = torch.randn(1, 40, 30), torch.randn(1, 40, 30)
    want = torch.nn.functional.kl_div(torch.log_softmax(logits, -1), torch.softmax(targets, -1),
                                      reduction="none").sum(-1)
    with torch.inference_mode():
        inference_targets = targets.clone()
        for _ in range(2):
            torch.testing.assert_close(kl_div(logits, inference_targets[:, 0:]), want, rtol=1e-5, atol=1e-6)
