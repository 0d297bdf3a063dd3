"""data: hidden-state capture throughput, bytes per token against the bf16 minimum, and the loader's tokens/s
against what a train step consumes, side by side in one run.

- ``capture``: ``build_data`` on the demo conversations with the tiny verifier (tokenise + verifier forward +
  shards), tokens/s of the whole call.
- ``storage``: shard bytes per token vs (aux + 1) x hidden x 2 (bf16), at the tiny and the real hidden size
  (synthetic shards with hidden 7168, three aux layers: 57 344 B/token minimum).
- ``loader``: memory-map the shards, draw token-budget batches (``train.batches``) and pack them
  (``train.model.pack``) as the worker does; tokens/s, with the page cache dropped first (cold) and again warm.
- ``train_step``: one bf16 AdamW step of the tiny drafter on the same packed batches (the loader's consumer);
  the ratio loader/train step says how far ahead of training the loader runs.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo" / "conversations.jsonl"


def _loader_tok_s(data_dir: Path, tokens_per_batch: int, batches: int, cold: bool) -> float:
    from benchmarks.parent_load import drop_page_cache
    from draftline.data.shards import open_prepared
    from draftline.drafter.batches import batches as batch_stream
    from draftline.drafter.model import pack

    if cold:
        drop_page_cache()
    t = time.perf_counter()
    records = open_prepared(data_dir).records()
    stream = batch_stream(records, tokens_per_batch, seed=0)
    n = 0
    for _ in range(batches):
        n += pack(next(stream))["input_ids"].numel()
    return n / (time.perf_counter() - t)


def _synthetic_real_shards(out: Path, tokens: int, per_sample: int = 1024) -> dict:
    """Shards at the real shape (hidden 7168, 3 aux layers) with random content, written by our writer."""
    from draftline.data import shards

    hidden, aux, vocab = 7168, 3, 163840
    writer = shards.ShardWriter(out, "bench", shard_tokens=8192, vocab_size=vocab)
    g = torch.Generator().manual_seed(0)
    for _ in range(tokens // per_sample):
        writer.add({"input_ids": torch.randint(0, vocab, (per_sample,), generator=g),
                    "loss_mask": torch.ones(per_sample, dtype=torch.bool),
                    "hidden_states": torch.randn(per_sample, aux * hidden, generator=g).to(torch.bfloat16),
                    "verifier_last_hidden_states": torch.randn(per_sample, hidden, generator=g).to(torch.bfloat16)})
        writer.boundary()
    writer.boundary(final=True)
    manifest = {"verifier": "synthetic", "aux_layer_ids": [2, 30, 58], "hidden_size": hidden, "vocab_size": vocab,
                "shards": writer.entries, "samples": writer.done_samples, "tokens": writer.done_tokens}
    return shards.write_manifest(out, manifest)


def run(tokens_per_batch: int = 2048, real_tokens: int = 16384) -> dict:
    from draftline.config import PrepareConfig
    from draftline.data.prepare import build_data
    from draftline.data.shards import open_prepared
    from draftline.drafter.batches import batches as batch_stream
    from draftline.drafter.model import build_draft_model, forward, loss_config, pack, trainable_parameters
    from draftline.drafter.vocab import build_vocab
    from draftline.testing.tiny import make_tiny

    with tempfile.TemporaryDirectory(prefix="draftline-bench-data-") as tmp:
        tmp = Path(tmp)
        tiny = make_tiny(tmp / "tiny", DEMO, parent_steps=0, progress=False)
        cfg = PrepareConfig(conversations=str(DEMO), verifier=str(tiny["verifier"]), max_length=512,
                            shard_tokens=8192)
        t = time.perf_counter()
        manifest = build_data(cfg, tmp / "data", progress=False)
        capture_s = time.perf_counter() - t
        shard_bytes = sum((tmp / "data" / e["file"]).stat().st_size for e in manifest["shards"])

        loader_cold = _loader_tok_s(tmp / "data", tokens_per_batch, 20, cold=True)
        loader_warm = _loader_tok_s(tmp / "data", tokens_per_batch, 20, cold=False)

        data = open_prepared(tmp / "data")
        d2t, t2d = build_vocab(data.token_freqs(), 256)
        model = build_draft_model(str(tiny["verifier"]), d2t=d2t, t2d=t2d, aux_layer_ids=manifest["aux_layer_ids"],
                                  draft_vocab_size=256, dtype=torch.bfloat16)
        params = trainable_parameters(model)
        opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95))
        stream, cfg_loss, step_s = batch_stream(data.records(), tokens_per_batch, seed=0), loss_config(), []
        for i in range(6):
            batch = pack(next(stream))
            t = time.perf_counter()
            loss, _ = forward(model, batch, 3, cfg_loss)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if i >= 1:
                step_s.append((time.perf_counter() - t, batch["input_ids"].numel()))
        train_tok_s = sum(n for _, n in step_s) / sum(s for s, _ in step_s)

        real = _synthetic_real_shards(tmp / "real", real_tokens)
        real_bytes = sum((tmp / "real" / e["file"]).stat().st_size for e in real["shards"])
        real_cold = _loader_tok_s(tmp / "real", 8192, 2, cold=True)
        real_warm = statistics.median(_loader_tok_s(tmp / "real", 8192, 2, cold=False) for _ in range(3))

    floor_tiny = manifest["bytes_per_token"]
    return {
        "shape": "tiny+real",
        "capture": {"tokens": manifest["tokens"], "samples": manifest["samples"], "seconds": round(capture_s, 2),
                    "tokens_per_s": round(manifest["tokens"] / capture_s)},
        "storage": {"tiny_bytes_per_token": round(shard_bytes / manifest["tokens"], 1),
                    "tiny_bf16_minimum": floor_tiny,
                    "real_bytes_per_token": round(real_bytes / real["tokens"], 1),
                    "real_bf16_minimum": (3 + 1) * 7168 * 2},
        "loader": {"tiny_cold_tok_s": round(loader_cold), "tiny_warm_tok_s": round(loader_warm),
                   "real_cold_tok_s": round(real_cold), "real_warm_tok_s": round(real_warm),
                   "real_cold_MBps": round(real_cold * real_bytes / real["tokens"] / 1e6)},
        "train_step": {"tiny_bf16_tok_s": round(train_tok_s), "tokens_per_batch": tokens_per_batch},
        "summary": {
            "capture tok/s (tiny verifier)": round(manifest["tokens"] / capture_s),
            "bytes/token vs bf16 minimum (tiny)": round(shard_bytes / manifest["tokens"] / floor_tiny, 4),
            "bytes/token vs bf16 minimum (real)": round(real_bytes / real["tokens"] / ((3 + 1) * 7168 * 2), 4),
            "loader cold / train step (tiny)": round(loader_cold / train_tok_s, 1),
            "real loader cold tok/s": round(real_cold),
        },
    }
