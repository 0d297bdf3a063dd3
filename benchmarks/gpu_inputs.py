"""The GPU check's finetune inputs, made on the spot with random content and the real layouts:

* a verifier directory with Kimi-K2's vocabulary and hidden size (a Llama ``config.json`` deep enough for aux
  layers [2, 30, 58], tied embeddings as the only weights: all a drafter reads from its verifier);
* a parent in the AQ-MedAI/SpecForge layout (``midlayer.*``, head_dim 128), as ``benchmarks.parent_load``
  writes it, with the ``config.json`` SpecForge writes;
* prepared data: hidden-state shards written by our shard writer and a manifest naming that verifier.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from benchmarks.common import AUX, SHAPES

SERVING_ID = "moonshotai/Kimi-K2-Instruct"  # what the data records as the verifier's serving id


def write_verifier(shape: str, out: Path) -> Path:
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    s = SHAPES[shape]
    LlamaConfig(hidden_size=s["hidden_size"], vocab_size=s["vocab_size"], num_hidden_layers=max(AUX) + 3,
                intermediate_size=s["intermediate_size"], num_attention_heads=s["num_attention_heads"],
                num_key_value_heads=s["num_key_value_heads"], head_dim=s["head_dim"], tie_word_embeddings=True,
                architectures=["LlamaForCausalLM"]).to_json_file(str(out / "config.json"))
    g = torch.Generator().manual_seed(1)
    embed = torch.empty(s["vocab_size"], s["hidden_size"], dtype=torch.bfloat16).normal_(0.0, 0.02, generator=g)
    norm = torch.ones(s["hidden_size"], dtype=torch.bfloat16)
    save_file({"model.embed_tokens.weight": embed, "model.norm.weight": norm}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out


def write_parent(shape: str, out: Path) -> Path:
    from benchmarks.parent_load import write_checkpoint

    s = SHAPES[shape]
    write_checkpoint(shape, out)
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
           **{k: s[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                "head_dim", "vocab_size", "draft_vocab_size", "rope_theta", "rms_norm_eps",
                                "max_position_embeddings")},
           "num_hidden_layers": 1, "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX}}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def write_data(shape: str, out: Path, verifier: Path, samples: int, sample_tokens: int) -> Path:
    from draftline.data import shards

    s = SHAPES[shape]
    hidden, vocab = s["hidden_size"], s["vocab_size"]
    writer = shards.ShardWriter(out, "gpu-check", shard_tokens=4 * sample_tokens, vocab_size=vocab)
    g = torch.Generator().manual_seed(0)
    for _ in range(samples):
        writer.add({"input_ids": torch.randint(0, vocab, (sample_tokens,), generator=g),
                    "loss_mask": torch.ones(sample_tokens, dtype=torch.bool),
                    "hidden_states": torch.randn(sample_tokens, len(AUX) * hidden, generator=g).to(torch.bfloat16),
                    "verifier_last_hidden_states": torch.randn(sample_tokens, hidden, generator=g).to(torch.bfloat16)})
        writer.boundary()
    writer.boundary(final=True)
    entries = writer.entries
    shards.write_manifest(out, {
        "format_version": shards.FORMAT_VERSION, "verifier": str(verifier), "verifier_name": str(verifier),
        "verifier_id": SERVING_ID, "verifier_revision": "random", "num_hidden_layers": max(AUX) + 3,
        "hidden_size": hidden, "vocab_size": vocab, "aux_layer_ids": AUX, "dtype": "bfloat16",
        "capture_backend": "synthetic", "bytes_per_token": (len(AUX) + 1) * hidden * 2, "max_length": sample_tokens,
        "samples": sum(e["samples"] for e in entries), "tokens": sum(e["tokens"] for e in entries),
        "masked_tokens": sum(e["masked_tokens"] for e in entries), "skipped_records": 0,
        "source": str(out.resolve()), "location": str(out.resolve()), "shards": entries})
    return out


def make_inputs(shape: str, root: Path, *, samples: int, sample_tokens: int) -> dict:
    dirs = {k: root / k for k in ("verifier", "parent", "data")}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    write_verifier(shape, dirs["verifier"])
    write_parent(shape, dirs["parent"])
    write_data(shape, dirs["data"], dirs["verifier"], samples, sample_tokens)
    sizes = {k: sum(p.stat().st_size for p in d.rglob("*") if p.is_file()) for k, d in dirs.items()}
    return {**dirs, "sizes": sizes}
