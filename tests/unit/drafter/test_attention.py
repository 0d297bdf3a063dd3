"""The blockwise draft attention is speculators' masked attention: same outputs and gradients as ``sdpa`` over
packed samples of different lengths at every draft position, and ``sdpa`` itself for any other mask."""

import pytest
import torch

from benchmarks.common import bench_model
from draftline.drafter import attention
from draftline.drafter.model import forward, pack


def _batch(model, lengths, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h, aux = model.hidden_size, len(model.config.eagle_aux_hidden_state_layer_ids)
    samples = [{"input_ids": torch.randint(0, model.verifier_vocab_size, (n,), generator=g),
                "loss_mask": torch.arange(n) >= n // 3,  # a prompt, then the reply trained on
                "hidden_states": torch.randn(n, aux * h, generator=g).to(dtype),
                "verifier_last_hidden_states": torch.randn(n, h, generator=g).to(dtype)} for n in lengths]
    return pack(samples)


def _train_once(attn, dtype, lengths):
    torch.manual_seed(0)
    model = bench_model("tiny", "cpu", dtype=dtype, attn=attn)
    loss, metrics = forward(model, _batch(model, lengths, dtype), ttt_steps=3)
    loss.backward()
    return loss.detach(), metrics, {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_loss_metrics_and_gradients_equal_sdpa(dtype, tol):
    lengths = [7, 40, 1, 23, 61]  # uneven, one sample a single token after the shift drops one
    want_loss, want_metrics, want = _train_once("sdpa", dtype, lengths)
    got_loss, got_metrics, got = _train_once(attention.NAME, dtype, lengths)
    torch.testing.assert_close(got_loss, want_loss, rtol=tol / 10, atol=0)
    for key in want_metrics:
        if "acc" in key:  # the draft's own choices: equal counts
            assert float(got_metrics[key]) == float(want_metrics[key]), key
    assert got.keys() == want.keys() and len(got) > 5
    for name in want:
        err = (got[name] - want[name]).norm() / want[name].norm()
        assert err < tol, f"{name}: relative error {err:.2e}"


def _layer_and_qkv(steps=3, t=12, seed=0):
    model = bench_model("tiny", "cpu", dtype=torch.float32)
    module = model.layers[0].self_attn
    g = torch.Generator().manual_seed(seed)
    heads, kv, d = module.config.num_attention_heads, module.config.num_key_value_heads, module.head_dim
    return (module, torch.randn(1, heads, t, d, generator=g), torch.randn(1, kv, steps * t, d, generator=g),
            torch.randn(1, kv, steps * t, d, generator=g))


def _mask(ids: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """speculators' TTT mask for three steps (``create_combined_mask_mod``), boolean ``[T, 3T]``."""
    t = ids.numel()
    q, k = torch.arange(t)[:, None], torch.arange(t)[None, :]
    first = (q >= k) & (ids[:, None] != -1) & (ids[:, None] == ids[None, :])
    if window is not None:
        first &= k > q - window
    eye = q == k
    return torch.cat([first | eye, eye, eye], dim=1)


def test_padding_rows_are_one_token_samples_and_any_other_mask_is_sdpa_itself():
    """speculators' padding (document id -1) leaves a row only its diagonals: a one-token sample, computed
    blockwise. A pair across samples attended, or a sliding window, is not the TTT mask over contiguous samples:
    the whole mask goes to transformers' sdpa, unchanged."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module, q, k, v = _layer_and_qkv()
    packed = _mask(torch.tensor([0] * 5 + [1] * 7))
    padded = _mask(torch.tensor([0] * 5 + [1] * 5 + [-1] * 2))
    assert attention.spans(packed, 3) == [(0, 5), (5, 12)]
    assert attention.spans(padded, 3) == [(0, 5), (5, 10), (10, 11), (11, 12)]
    across = packed.clone()
    across[8, 2] = True
    window = _mask(torch.tensor([0] * 5 + [1] * 7), window=3)
    for mask, ours in ((packed, True), (padded, True), (across, False), (window, False)):
        assert (attention.spans(mask, 3) is not None) == ours
        want, _ = sdpa_attention_forward(module, q, k, v, mask[None, None], scaling=module.scaling)
        got, _ = attention.blockwise_attention(module, q, k, v, mask[None, None], scaling=module.scaling)
        if ours:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(got, want)


def test_auto_is_blockwise_on_cpu_ranks_and_sdpa_on_gpus():
    assert attention.choose("auto", on_cpu=True) == "blockwise"
    assert attention.choose("auto", on_cpu=False) == "sdpa"
    assert attention.choose("eager", on_cpu=True) == "eager"
