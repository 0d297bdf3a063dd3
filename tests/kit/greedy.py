"""Drafters trained and judged on the tiny verifier's own greedy replies (tests and benchmarks of evaluation).

The tiny verifier's greedy output is far from the demo conversations, so a drafter trained on those barely
drafts it; as with real regenerated data (``prepare --regenerate-endpoint``), the drafter here learns from the
verifier's own replies.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig

from draftline.data.capture import capture_hidden_states
from draftline.data.conversations import load_conversations
from draftline.data.tokenize import TokenizedSample
from draftline.drafter.checkpoints import VERIFIER_OWNED, to_midlayer_layout
from draftline.drafter.model import (
    accumulate,
    build_draft_model,
    forward,
    loss_config,
    pack,
    summarise,
    train_steps_in_process,
)
from draftline.drafter.shape import specforge_config
from draftline.drafter.vocab import build_vocab


def chat_prompts(tokenizer, conversations: Path, count: int, offset: int = 0, max_chars: int = 200) -> list[list[int]]:
    """Token ids of ``count`` first user turns (cut at ``max_chars``), each with the generation prompt."""
    users = [c["messages"][0]["content"] for c in load_conversations(conversations).samples
             if c["messages"] and c["messages"][0]["role"] == "user"][offset:offset + count]
    return [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": u[:max_chars]}],
                                                    add_generation_prompt=True, tokenize=False),
                      add_special_tokens=False)["input_ids"] for u in users]


@torch.inference_mode()
def greedy_replies(verifier, prompts: list[list[int]], max_new_tokens: int, pad_token_id: int,
                   batch_size: int = 32) -> list[list[int]]:
    """The verifier's greedy continuations, batched with left padding (no EOS stop)."""
    out: list[list[int]] = []
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i:i + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        gen = verifier.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                                min_new_tokens=max_new_tokens, pad_token_id=pad_token_id)
        out += [gen[j, width:].tolist() for j in range(len(batch))]
    return out


def records(verifier, prompts: list[list[int]], replies: list[list[int]], aux_layer_ids: list[int]) -> list[dict]:
    """Captured samples (prompt + reply, loss on the reply), hidden states in float32."""
    samples = [TokenizedSample(str(i), p + r, [0] * len(p) + [1] * len(r))
               for i, (p, r) in enumerate(zip(prompts, replies, strict=True))]
    return [{k: (v.float() if v.is_floating_point() else v) for k, v in rec.items()}
            for rec in capture_hidden_states(verifier, samples, aux_layer_ids)]


def train_drafter(verifier_dir: Path, recs: list[dict], *, aux_layer_ids: list[int], steps: int,
                  draft_vocab_size: int = 256, seed: int = 0):
    """A drafter (random init, vocabulary from the replies' tokens) trained ``steps`` bare AdamW steps."""
    size = AutoConfig.from_pretrained(verifier_dir).vocab_size
    freqs = torch.zeros(size, dtype=torch.long)
    for r in recs:
        freqs += torch.bincount(r["input_ids"][r["loss_mask"]], minlength=size)
    d2t, t2d = build_vocab(freqs, draft_vocab_size)
    torch.manual_seed(seed)
    model = build_draft_model(str(verifier_dir), d2t=d2t, t2d=t2d, aux_layer_ids=aux_layer_ids,
                              draft_vocab_size=draft_vocab_size, dtype=torch.float32)
    train_steps_in_process(model, recs, steps=steps, lr=3e-3, tokens_per_batch=512, seed=seed)
    return model.eval()


@torch.inference_mode()
def teacher_forced(drafter, recs: list[dict], ttt_steps: int = 3) -> dict[str, float]:
    """speculators' teacher-forced metrics (``full_acc_k``/``cond_acc_k``, over the draft vocabulary), plus
    ``full_vocab_acc_0``: how often the first draft (mapped to the verifier's ids) is the verifier's next token."""
    sums: dict[str, float] = {}
    hits = total = 0
    for i in range(0, len(recs), 8):
        batch = pack(recs[i:i + 8])
        accumulate(sums, forward(drafter, batch, ttt_steps, loss_config())[1])
        plain = {k: v for k, v in batch.items() if k not in ("verifier_last_hidden_states", "loss_mask")}
        first = drafter(**plain, ttt_steps=1)[0][0]
        if drafter.d2t is not None:  # verifier ids (a whole-vocabulary drafter's are already)
            first = first + drafter.d2t[first]
        start = 0
        for r in recs[i:i + 8]:  # shifted position j pairs hidden j with token j+1 and drafts token j+2
            n = r["input_ids"].numel()
            keep = r["loss_mask"][2:]
            hits += int(((first[start:start + n - 2] == r["input_ids"][2:]) & keep).sum())
            total += int(keep.sum())
            start += n - 1
    out = summarise(sums, ttt_steps)
    out["full_vocab_acc_0"] = hits / total if total else 0.0
    return out


def save_drafter(model, verifier_dir: Path, out: Path) -> Path:
    """Write ``model`` as a drafter directory in the SpecForge/AQ-MedAI layout (as the tiny parent is)."""
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()
             if k not in VERIFIER_OWNED}
    save_file(to_midlayer_layout(state), out / "model.safetensors", metadata={"format": "pt"})
    cfg = specforge_config(AutoConfig.from_pretrained(verifier_dir), draft_vocab_size=int(model.d2t.numel()),
                           aux_layer_ids=list(model.config.eagle_aux_hidden_state_layer_ids))
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out
