"""Drafter configs for benchmarks: the tiny ones the tests use, and the real Kimi EAGLE-3 shapes (AQ-MedAI's Llama
layer for Kimi-K2, lightseek's MLA layer for Kimi-K2.5)."""

from __future__ import annotations

import torch

from draftline.drafter.layer_kinds import KIMI_K2, KIMI_K25_MLA

SHAPES = {
    # the tiny one the tests use: hidden, intermediate, heads, kv heads, head_dim, target and draft vocab
    "tiny": {**KIMI_K2, **dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=32, vocab_size=1024, draft_vocab_size=256)},
    # the SmolLM2-135M-Instruct drafter the real tier trains (its verifier's own Llama layer)
    "smollm2": {**KIMI_K2, **dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                                  num_key_value_heads=3, head_dim=64, vocab_size=49152, draft_vocab_size=8192,
                                  rope_theta=100000.0)},
    # AQ-MedAI/Kimi-K2-Instruct-eagle3's config.json: head_dim 128 (not hidden / heads = 112)
    "real": KIMI_K2,
    # the Kimi-shaped miniature's Llama-layer drafter (draftline make-tiny --family kimi: parent), heads of v_head_dim
    "tiny-kimi": {**KIMI_K2, **dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                    num_key_value_heads=4, head_dim=128, vocab_size=527, draft_vocab_size=256)},
}
# MLA layers (drafter_config builds them with mla_drafter_config): DeepSeek's head dims, as vLLM's CPU MLA serves
MLA_SHAPES = {
    # the tiny one the tests use, beside "tiny": hidden 128, 4 heads, no query LoRA
    "tiny-mla": {**KIMI_K25_MLA, **dict(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                        num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=512,
                                        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=1024,
                                        draft_vocab_size=256, rope_parameters={"rope_type": "default",
                                                                               "rope_theta": 10000.0})},
    # the Kimi-shaped miniature's MLA drafter (draftline make-tiny --family kimi: parent-mla)
    "tiny-kimi-mla": {**KIMI_K25_MLA, **dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                             num_key_value_heads=4, q_lora_rank=128, vocab_size=527,
                                             draft_vocab_size=256)},
    # lightseekorg/kimi-k2.5-eagle3-mla's config.json
    "real-mla": KIMI_K25_MLA,
}
SHAPES.update(MLA_SHAPES)
AUX = KIMI_K2["aux_layer_ids"]


def drafter_config(shape: str, attn: str = "sdpa", form=None):
    """The speculators config of the shape: one Llama (or, for :data:`MLA_SHAPES`, MLA) layer, as ``draftline
    plan`` builds it; ``attn`` is the
    draft attention (``sdpa``, ``eager``, or ``simple_flex_attention``, speculators' default, which needs a GPU);
    ``form`` its EAGLE form (default 3.0)."""
    from draftline.drafter import layer_kinds
    from draftline.drafter.form import EagleForm

    s = SHAPES[shape]
    kind = layer_kinds.named("mla" if shape in MLA_SHAPES else "llama")
    config = kind.drafter_config(s, draft_vocab_size=s["draft_vocab_size"], aux_layer_ids=s.get("aux_layer_ids", AUX),
                                 form=form or EagleForm())
    config.transformer_layer_config._attn_implementation = attn  # noqa: SLF001
    return config


def bench_model(shape: str, device, dtype=torch.bfloat16, init: bool = True, attn: str = "sdpa", form=None):
    """An ``Eagle3DraftModel`` of the shape, built on the meta device and materialised directly in ``dtype``
    (no fp32 copy), verifier-owned weights random (no verifier checkpoint is needed)."""
    from draftline.drafter.model import meta_drafter

    model = meta_drafter(drafter_config(shape, form=form), dtype=dtype, attn=attn).to_empty(device=device)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if not t.is_floating_point():
                continue
            if name.endswith("norm.weight"):
                t.fill_(1.0)
            elif init:
                t.normal_(0.0, 0.02)
            else:
                t.zero_()
        if model.t2d is not None:
            ids = torch.arange(model.draft_vocab_size, device=device) * (model.verifier_vocab_size //
                                                                         model.draft_vocab_size)
            model.t2d.zero_()
            model.t2d[ids] = True
            model.d2t.copy_(ids - torch.arange(model.draft_vocab_size, device=device))
    rot = model.rotary_emb  # its inv_freq buffers were on meta: rebuild it where the model now lives
    model.rotary_emb = type(rot)(rot.config).to(device)
    return model


def fake_batch(model, tokens: int, device, seed: int = 0, docs: int = 4) -> dict[str, torch.Tensor]:
    """``docs`` random samples packed as training packs them (shifted into vLLM's pairing): ``tokens`` in all."""
    from draftline.drafter.model import pack

    g = torch.Generator().manual_seed(seed)
    h = model.hidden_size
    aux = len(model.config.eagle_aux_hidden_state_layer_ids)
    per = tokens // docs + 1  # the shift drops one token per sample
    samples = [{"input_ids": torch.randint(0, model.verifier_vocab_size, (per,), generator=g),
                "loss_mask": torch.ones(per, dtype=torch.bool),
                "hidden_states": torch.randn(per, aux * h, generator=g).to(torch.bfloat16),
                "verifier_last_hidden_states": torch.randn(per, h, generator=g).to(torch.bfloat16)}
               for _ in range(docs)]
    return pack(samples, device)
