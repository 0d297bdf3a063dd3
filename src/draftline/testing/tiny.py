"""A tiny verifier and a tiny AQ-MedAI-layout parent, built locally (no model hub).

``make_tiny(out_dir)`` writes::

    out_dir/verifier/   a Llama-family causal LM + byte-level BPE tokenizer with a ChatML chat template
    out_dir/parent/     an EAGLE-3 drafter for it in the SpecForge/AQ-MedAI layout
                        (``midlayer.*``, ``fc``, ``norm``, ``lm_head``, ``d2t``, ``t2d`` + SpecForge config.json)

The verifier is deep enough (8 layers) that the default aux layers [2, 4, 5] do not collide, and it is
initialised with a wide init range so its next-token distribution is peaked (a drafter has something to learn).
The parent is trained for a few steps on the verifier's own hidden states, so finetuning from it starts ahead
of a random init, as a real parent would.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from draftline.data.capture import capture_hidden_states
from draftline.data.conversations import load_conversations
from draftline.data.tokenize import tokenize_conversations
from draftline.drafter import layer_kinds
from draftline.drafter.checkpoints import to_midlayer_layout
from draftline.drafter.form import EagleForm, with_form
from draftline.drafter.model import build_draft_model, train_steps_in_process
from draftline.drafter.served import save_served
from draftline.drafter.shape import default_aux_layers, layer_config, specforge_config
from draftline.drafter.vocab import build_vocab

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]

TINY_VERIFIER_ID = "draftline/tiny-verifier"  # as configs/parents.yaml names it
TINY_DEFAULTS: dict[str, Any] = dict(
    vocab_size=1024,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    draft_vocab_size=256,
    init_range=0.2,
)


def _corpus_texts(conversations: Path) -> list[str]:
    return [m["content"] for conv in load_conversations(conversations).samples for m in conv["messages"]]


def build_tokenizer(texts: list[str], vocab_size: int):
    """Train a byte-level BPE on ``texts`` and wrap it as a transformers fast tokenizer with a chat template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        bos_token="<|endoftext|>",
        pad_token="<|pad|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
    )


def build_verifier(tokenizer, *, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
                   num_key_value_heads, init_range, seed: int = 0):
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        initializer_range=init_range,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    return model.eval()


def make_tiny(out_dir: Path, conversations: Path, *, parent_steps: int = 60, seed: int = 0,
              progress: bool = True) -> dict[str, Path]:
    """Build the tiny verifier and its tiny parent under ``out_dir``; returns their paths."""
    out_dir = Path(out_dir)
    verifier_dir, parent_dir = out_dir / "verifier", out_dir / "parent"
    texts = _corpus_texts(conversations)
    tokenizer = build_tokenizer(texts, TINY_DEFAULTS["vocab_size"])
    verifier = build_verifier(tokenizer, **{k: v for k, v in TINY_DEFAULTS.items()
                                            if k not in ("vocab_size", "draft_vocab_size")}, seed=seed)
    verifier_dir.mkdir(parents=True, exist_ok=True)
    verifier.save_pretrained(verifier_dir, safe_serialization=True)
    tokenizer.save_pretrained(verifier_dir)
    # the id serving hosts know it by, as a model downloaded from a hub records it (draftline reads it back)
    cfg_file = verifier_dir / "config.json"
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), "_name_or_path": TINY_VERIFIER_ID}, indent=2))

    parent_dir = write_parent(verifier, verifier_dir, tokenizer, conversations, parent_dir,
                              draft_vocab_size=TINY_DEFAULTS["draft_vocab_size"], parent_steps=parent_steps,
                              seed=seed, progress=progress)
    return {"verifier": verifier_dir, "parent": parent_dir}


def parent_data(verifier, tokenizer, conversations: Path, *, progress: bool) -> tuple[list, list[dict]]:
    """What a parent of ``verifier`` learns from: the first half of ``conversations`` tokenised (at most 512
    tokens each), and the verifier's hidden states on them at its default aux layers."""
    # The parent learns from the first half of the conversations; users finetune on whatever they bring.
    samples = tokenize_conversations(load_conversations(conversations).samples, tokenizer, max_length=512)
    samples = samples[: max(1, len(samples) // 2)]
    aux = default_aux_layers(verifier.config.num_hidden_layers)
    return samples, capture_hidden_states(verifier, samples, aux, progress=progress)


def write_parent(verifier, verifier_dir: Path, tokenizer, conversations: Path, parent_dir: Path, *,
                 draft_vocab_size: int, parent_steps: int, seed: int, progress: bool, layer_kind: str = "llama",
                 served_id: str | None = None, form: EagleForm = EagleForm(),
                 data: tuple[list, list[dict]] | None = None) -> Path:
    """A parent for ``verifier`` (its causal LM, saved in ``verifier_dir``): a drafter trained ``parent_steps``
    steps on the verifier's hidden states over the first half of ``conversations``, saved in bf16 with
    ``midlayer.*`` keys. ``layer_kind`` ``llama``: AQ-MedAI's layout (a Llama layer, ``d2t``/``t2d``, SpecForge's
    config.json). ``mla``: lightseekorg/kimi-k2.5-eagle3-mla's (one MLA layer, vLLM's flat
    ``Eagle3DeepseekV2ForCausalLM`` config.json, the verifier's whole vocabulary as draft vocabulary, so no
    ``d2t``/``t2d``; ``draft_vocab_size`` is ignored). ``form``: EAGLE 3.0, or 3.1 (``fc_norm.{i}.weight`` and
    ``norm_output``, as lightseekorg/kimi-k2.6-eagle3.1-mla). ``data``: :func:`parent_data` for this verifier
    and these conversations, captured once for several parents (default: captured here)."""
    samples, batch = data if data is not None else parent_data(verifier, tokenizer, conversations,
                                                               progress=progress)
    vocab_size = verifier.config.vocab_size
    aux = default_aux_layers(verifier.config.num_hidden_layers)
    freqs = torch.zeros(vocab_size, dtype=torch.long)
    for s in samples:
        ids = torch.tensor(s.input_ids)[torch.tensor(s.loss_mask, dtype=torch.bool)]
        freqs += torch.bincount(ids, minlength=vocab_size)
    kind = layer_kinds.named(layer_kind)
    if kind.whole_vocabulary():  # the whole vocabulary, row i drafting token i, as the published one
        draft_vocab_size = vocab_size
        d2t, t2d = torch.zeros(vocab_size, dtype=torch.long), torch.ones(vocab_size, dtype=torch.bool)
    else:
        d2t, t2d = build_vocab(freqs, draft_vocab_size)

    torch.manual_seed(seed)
    # fp32 here only because bf16 matmuls are ~10x slower on a CPU; the parent is saved in bf16 like AQ-MedAI's
    layer = with_form(layer_config(str(verifier_dir), None, layer_kind), form)
    model = build_draft_model(str(verifier_dir), d2t=d2t, t2d=t2d, aux_layer_ids=aux,
                              draft_vocab_size=draft_vocab_size, dtype=torch.float32, layer=layer)
    train_steps_in_process(model, batch, steps=parent_steps, lr=3e-3, tokens_per_batch=512, seed=seed,
                           progress=progress)

    parent_dir.mkdir(parents=True, exist_ok=True)
    if kind.whole_vocabulary():  # lightseek's layout: the form vLLM serves, no d2t/t2d
        save_served(model.to(torch.bfloat16), parent_dir, served_id or str(verifier_dir))
        weights = load_file(parent_dir / "model.safetensors")  # lightseek's ships no d2t/t2d: the vocabulary is whole
        save_file({k: v for k, v in weights.items() if k not in ("d2t", "t2d")}, parent_dir / "model.safetensors",
                  metadata={"format": "pt"})
        return parent_dir
    state = to_midlayer_layout({k: v.detach().to(torch.bfloat16) if v.is_floating_point() else v
                                for k, v in model.state_dict().items()})
    save_file(state, parent_dir / "model.safetensors", metadata={"format": "pt"})
    cfg = specforge_config(model.config.transformer_layer_config, draft_vocab_size=draft_vocab_size,
                           aux_layer_ids=aux, form=form)
    (parent_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return parent_dir
