"""A tiny verifier of Kimi-K2's architecture, in the forms Kimi ships, and three parents for it (AQ-MedAI's Llama
layer, lightseek's MLA one, and lightseek's EAGLE 3.1 MLA one).

``make_tiny_kimi(out_dir)`` writes::

    out_dir/verifier/            ``kimi_k2`` as Kimi-K2-Instruct ships it: config, model and tokenizer as custom code
                                 (``auto_map``; draftline's own classes in ``kimi_code/``), needs --trust-remote-code
    out_dir/verifier-k25/        ``kimi_k25`` as Kimi-K2.5 ships it: transformers' multimodal wrapper, the same
                                 DeepSeek-V3 language model under ``text_config`` beside a small vision tower
    out_dir/verifier-quantized/  the ``kimi_k2`` directory with a ``quantization_config`` (config only; the
                                 weights are links), for the trap of a drafter that inherits it
    out_dir/parent/              an EAGLE-3 drafter in AQ-MedAI's layout (``midlayer.*``, a Llama layer,
                                 ``d2t``/``t2d``, SpecForge's config.json), trained a little on the verifier
    out_dir/parent-mla/          an MLA EAGLE-3 drafter in lightseekorg/kimi-k2.5-eagle3-mla's layout (one
                                 DeepSeek-V3 MLA layer, ``midlayer.*``, vLLM's flat config.json, the whole
                                 vocabulary as draft vocabulary), trained as much on the verifier
    out_dir/parent-mla31/        the same in lightseekorg/kimi-k2.6-eagle3.1-mla's EAGLE 3.1 form: ``fc_norm:
                                 true`` with ``fc_norm.{i}.weight``, ``norm_output: true``

The language model is transformers' ``DeepseekV3ForCausalLM`` with random weights: hidden 256, 8 layers,
4 heads, MLA with DeepSeek's own head dims (vLLM's CPU MLA backend serves no other, and only in bf16), 8 routed
experts of which 2 per token plus 1 shared, the first layer dense, sigmoid ``noaux_tc`` routing, Kimi's yarn rope
(:data:`ROPE_SCALING`). Its tokenizer has Kimi's chat tokens and ``<think>``/``</think>``: a reasoning verifier,
served with ``--reasoning-parser kimi_k2`` as Kimi-K2.5 is.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from draftline.drafter.form import EagleForm
from draftline.testing.kimi_k25 import write_k25
from draftline.testing.tiny import _corpus_texts, build_tokenizer, parent_data, write_parent

KIMI_VERIFIER_ID = "draftline/tiny-kimi-k2"
KIMI_K25_VERIFIER_ID = "draftline/tiny-kimi-k25"
CODE = Path(__file__).parent / "kimi_code"
# Kimi's chat roles: <|im_user|>user<|im_middle|>...<|im_end|>
KIMI_SPECIAL = ["<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>", "<|media_begin|>",
                "<|media_content|>", "<|media_end|>", "<|media_pad|>", "<|kimi_k25_video_placeholder|>",
                "<think>", "</think>"]
# Kimi-K2.5's template in miniature: past assistant turns without their thinking; the generation prompt opens the
# reply, and with chat_template_kwargs {"thinking": false} closes an empty thinking block (instant mode).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_' + message['role'] + '|>' + message['role'] + '<|im_middle|>' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_assistant|>assistant<|im_middle|>' }}"
    "{% if thinking is defined and not thinking %}{{ '<think></think>' }}{% endif %}{% endif %}"
)
# Kimi-K2's and K2.5's rope as their config.json carries it: yarn over a 4,096-token original context (factor 32
# for K2's 131,072 positions). It is also what keeps the miniature what it claims in vLLM on a CPU: yarn takes
# vLLM's native rotary path, where plain rope went through a C++ op that misreads MLA's strided views.
ROPE_THETA = 50000.0
ROPE_SCALING = {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 1.0,
                "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
TEXT: dict[str, Any] = dict(
    hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=8,
    num_attention_heads=4, num_key_value_heads=4,
    q_lora_rank=128, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
    n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5, topk_method="noaux_tc",
    scoring_func="sigmoid",
    max_position_embeddings=131072, rms_norm_eps=1e-6, initializer_range=0.05, tie_word_embeddings=False,
)
# A random DeepSeek-V3 is either flat (init 0.02: top-1 probability ~0.005) or chaotic in bf16 (init 0.12: fp32
# and bf16 agree on the next token 51% of the time, measured on 256 random contexts). Moderate layers and a head
# scaled up give a peaked next token that bf16 mostly keeps; its weights are bf16 values in every form.
HEAD_SCALE = 8.0
# Kimi-K2.5 ships INT4 weights as compressed-tensors; Kimi-K2 FP8 blocks. A config-only stand-in.
QUANTIZATION = {"quant_method": "compressed-tensors", "format": "pack-quantized",
                "config_groups": {"group_0": {"targets": ["Linear"],
                                              "weights": {"num_bits": 4, "type": "int", "group_size": 32,
                                                          "symmetric": True, "strategy": "group"}}},
                "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*"]}
DRAFT_VOCAB = 256


def build_text_model(tokenizer, *, seed: int = 0):
    """The DeepSeek-V3 language model (random weights; see :data:`HEAD_SCALE`)."""
    rope = {"rope_type": "yarn", "rope_theta": ROPE_THETA, **{k: v for k, v in ROPE_SCALING.items() if k != "type"}}
    config = DeepseekV3Config(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                              eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                              rope_parameters=rope, **TEXT)
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(HEAD_SCALE)
    return model.to(torch.bfloat16).to(torch.float32)  # bf16 values, as Kimi ships them


def _kimi_tokenizer(texts: list[str], vocab_size: int):
    base = build_tokenizer(texts, vocab_size - len(KIMI_SPECIAL))
    base.add_special_tokens({"additional_special_tokens": KIMI_SPECIAL})
    base.chat_template = CHAT_TEMPLATE
    return base


def _write_k2(model, tokenizer, out: Path) -> None:
    """``out`` as Kimi-K2-Instruct lays it out: DeepSeek-V3 weights, a config under ``model_type: kimi_k2``
    whose ``auto_map`` names the shipped config and model classes, and a tokenizer shipped as code."""
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)  # exact: the values are bf16's
    model.to(torch.float32)
    tokenizer.save_pretrained(out)
    for name in ("configuration_kimi.py", "modeling_kimi.py", "tokenization_kimi.py"):
        shutil.copyfile(CODE / name, out / name)
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("rope_parameters", None)  # as Kimi ships it: rope_theta and rope_scaling
    cfg.update(model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"], _name_or_path=KIMI_VERIFIER_ID,
               rope_theta=ROPE_THETA, rope_scaling=ROPE_SCALING,
               auto_map={"AutoConfig": "configuration_kimi.KimiK2Config",
                         "AutoModel": "modeling_kimi.KimiK2Model",
                         "AutoModelForCausalLM": "modeling_kimi.KimiK2ForCausalLM"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    tok = json.loads((out / "tokenizer_config.json").read_text())
    tok.update(tokenizer_class="TinyKimiTokenizer",
               auto_map={"AutoTokenizer": ["tokenization_kimi.TinyKimiTokenizer", None]})
    (out / "tokenizer_config.json").write_text(json.dumps(tok, indent=2) + "\n")


def _write_quantized(k2: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for f in k2.iterdir():
        if f.suffix == ".safetensors":
            (out / f.name).symlink_to(f.resolve())
        elif f.is_file():
            shutil.copyfile(f, out / f.name)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "quantization_config": QUANTIZATION}, indent=2) + "\n")


def make_tiny_kimi(out_dir: Path, conversations: Path, *, parent_steps: int = 60, seed: int = 0,
                   progress: bool = True) -> dict[str, Path]:
    """Build the Kimi-shaped verifier in its three forms and its three parents under ``out_dir``; returns their
    paths."""
    out_dir = Path(out_dir)
    paths = {"verifier": out_dir / "verifier", "verifier_k25": out_dir / "verifier-k25",
             "verifier_quantized": out_dir / "verifier-quantized", "parent": out_dir / "parent",
             "parent_mla": out_dir / "parent-mla", "parent_mla31": out_dir / "parent-mla31"}
    tokenizer = _kimi_tokenizer(_corpus_texts(conversations), 1024)
    model = build_text_model(tokenizer, seed=seed)
    paths["verifier"].mkdir(parents=True, exist_ok=True)
    _write_k2(model, tokenizer, paths["verifier"])
    _write_quantized(paths["verifier"], paths["verifier_quantized"])
    write_k25(model, tokenizer, paths["verifier_k25"], seed=seed, served_id=KIMI_K25_VERIFIER_ID)
    # the parent is trained on the language model itself: its layer is derived from these sizes (a plain
    # deepseek_v3 config.json in a scratch folder; the custom-code directory needs no trust for it)
    scratch = out_dir / ".parent-verifier"
    model.save_pretrained(scratch, safe_serialization=True)
    try:  # the three parents learn from the same hidden states: captured once
        data = parent_data(model, tokenizer, conversations, progress=progress)
        write_parent(model, scratch, tokenizer, conversations, paths["parent"], draft_vocab_size=DRAFT_VOCAB,
                     parent_steps=parent_steps, seed=seed, progress=progress, data=data)
        write_parent(model, scratch, tokenizer, conversations, paths["parent_mla"], draft_vocab_size=DRAFT_VOCAB,
                     parent_steps=parent_steps, seed=seed, progress=progress, layer_kind="mla",
                     served_id=KIMI_VERIFIER_ID, data=data)
        write_parent(model, scratch, tokenizer, conversations, paths["parent_mla31"], draft_vocab_size=DRAFT_VOCAB,
                     parent_steps=parent_steps, seed=seed, progress=progress, layer_kind="mla",
                     served_id=KIMI_VERIFIER_ID, form=EagleForm(fc_norm=True, norm_output=True), data=data)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return paths


