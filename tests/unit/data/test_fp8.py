"""fp8 shards: hidden states in E4M3 with a scale per token and layer, half the bytes, read back to bf16."""

import pytest
import torch

from draftline.config import PrepareConfig
from draftline.data import fp8, storage
from draftline.data.prepare import build_data
from draftline.data.shards import open_prepared, write_shard

from ...conftest import DEMO


def test_each_row_keeps_its_own_range_within_e4m3s_rounding():
    torch.manual_seed(0)
    h = 64
    x = torch.randn(5, 3 * h)
    x[:, h:2 * h] *= 300.0  # a late layer's scale beside an early one's
    x[2, 7] = 5000.0  # one outlier channel: only its own row's scale moves
    q, scale = fp8.quantize(x.to(torch.bfloat16), h)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and scale.shape == (5, 3)
    back = fp8.dequantize(q, scale).float()
    rel = ((back - x).abs() / x.abs().clamp(min=1e-3)).reshape(5, 3, h)
    big = x.reshape(5, 3, h).abs() > x.reshape(5, 3, h).abs().amax(-1, keepdim=True) / 16  # E4M3's normal range
    assert rel[big].max() < 2 ** -3.5  # 3 mantissa bits (and bf16's 8 after it)
    assert back.dtype == torch.float32 and fp8.dequantize(q, scale).dtype == torch.bfloat16


def test_a_zero_row_stays_zero():
    q, scale = fp8.quantize(torch.zeros(2, 8, dtype=torch.bfloat16), 4)
    assert torch.equal(fp8.dequantize(q, scale), torch.zeros(2, 8, dtype=torch.bfloat16))


def test_the_kimi_k25_token_costs_half_in_fp8():
    assert storage.token_bytes(7168, 3, "fp8") == 4 * (7168 + 4) + 9
    assert storage.token_bytes(7168, 3, "fp8") / storage.token_bytes(7168, 3) == pytest.approx(0.5, abs=0.001)


def test_a_shard_in_fp8_reads_back_as_bf16_samples(tmp_path):
    torch.manual_seed(1)
    recs = [{"input_ids": torch.arange(n), "loss_mask": torch.ones(n, dtype=torch.bool),
             "hidden_states": torch.randn(n, 3 * 256).to(torch.bfloat16),
             "verifier_last_hidden_states": torch.randn(n, 256).to(torch.bfloat16)} for n in (50, 70)]
    bf = write_shard(tmp_path / "bf16.safetensors", recs)
    f8 = write_shard(tmp_path / "fp8.safetensors", recs, "fp8")
    assert (tmp_path / "fp8.safetensors").stat().st_size < 0.6 * (tmp_path / "bf16.safetensors").stat().st_size
    assert (bf["tokens"], bf["samples"]) == (f8["tokens"], f8["samples"])


def test_prepare_in_fp8_writes_half_the_bytes_and_trains_on_what_bf16_would(tiny, prepared, tmp_path):
    out = tmp_path / "fp8"
    manifest = build_data(PrepareConfig(conversations=str(DEMO), verifier=str(tiny["verifier"]), max_length=256,
                                        shard_tokens=4096, hidden_storage="fp8"), out, progress=False)
    bf16 = open_prepared(prepared)
    assert manifest["hidden_storage"] == "fp8" and bf16.manifest["hidden_storage"] == "bf16"
    assert manifest["digest"] != bf16.manifest["digest"]  # other bytes, another data set
    size = {d: sum((d / e["file"]).stat().st_size for e in m["shards"]) for d, m in ((prepared, bf16.manifest),
                                                                                      (out, manifest))}
    assert 0.45 < size[out] / size[prepared] < 0.60, size
    assert abs(manifest["tokens"] * manifest["bytes_per_token"] / size[out] - 1) < 0.01  # the estimate is the file
    ours, theirs = open_prepared(out).records(), bf16.records()
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        for key in ("hidden_states", "verifier_last_hidden_states"):
            assert a[key].dtype == torch.bfloat16 and a[key].shape == b[key].shape
            err = (a[key].float() - b[key].float()).norm() / b[key].float().norm()
            assert err < 0.05, (key, float(err))  # E4M3's rounding, relative to the row
        assert {**a}.keys() == {**b}.keys()  # a batch is built from it as from a bf16 sample
