"""warm-start: does a parent pay? On the tiny verifier, the parent (make-tiny trains it on the first half of
the demo conversations) and a random init are finetuned side by side on the second half with the same
batches; we count the steps each needs to reach the validation accuracy random init reaches at the end.

fp32 on the CPU (bf16 matmuls are ~10x slower here); same loop as the tiny parent's (bare AdamW).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def run(steps: int = 150, every: int = 10, metric: str = "full_acc_0", parent_steps: int = 600) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftline.checkpoints import find_checkpoint, load_into_model, read_tensors
    from draftline.data.capture import capture_hidden_states
    from draftline.data.conversations import load_conversations
    from draftline.data.tokenize import tokenize_conversations
    from draftline.testing.tiny import make_tiny
    from draftline.train.model import (
        accumulate,
        build_draft_model,
        forward,
        loss_config,
        pack,
        summarise,
        train_steps_in_process,
    )
    from draftline.train.worker import split_validation

    demo = ROOT / "configs" / "demo" / "conversations.jsonl"
    with tempfile.TemporaryDirectory(prefix="draftline-warm-") as tmp:
        # a parent trained 4x longer than the finetune (real parents are trained far longer than a finetune)
        tiny = make_tiny(Path(tmp), demo, parent_steps=parent_steps, progress=False)
        tok = AutoTokenizer.from_pretrained(tiny["verifier"])
        verifier = AutoModelForCausalLM.from_pretrained(tiny["verifier"]).eval()
        samples = tokenize_conversations(load_conversations(demo).samples, tok, 512)
        second_half = samples[len(samples) // 2:]  # the parent never saw these
        records = [{k: (v.float() if v.is_floating_point() else v) for k, v in r.items()}
                   for r in capture_hidden_states(verifier, second_half, [2, 4, 5])]
        train, val = split_validation(records, 0.2)
        vocab = read_tensors(find_checkpoint(tiny["parent"]), {"d2t", "t2d"})
        cfg = loss_config()

        def evaluate(model) -> dict[str, float]:
            model.eval()
            with torch.no_grad():
                sums = {}
                for i in range(0, len(val), 8):
                    accumulate(sums, forward(model, pack(val[i:i + 8]), 3, cfg)[1])
            model.train()
            return summarise(sums, 3)

        curves = {}
        for name in ("random", "parent"):
            torch.manual_seed(0)
            model = build_draft_model(str(tiny["verifier"]), d2t=vocab["d2t"], t2d=vocab["t2d"],
                                      aux_layer_ids=[2, 4, 5], draft_vocab_size=int(vocab["d2t"].numel()),
                                      dtype=torch.float32)
            if name == "parent":
                load_into_model(model, find_checkpoint(tiny["parent"]))
            curve = [(0, evaluate(model)[metric])]
            # same batches in the same order for both (the order depends on the seed only)
            train_steps_in_process(model, train, steps=steps, lr=1e-3, tokens_per_batch=512, seed=0,
                                   callback=lambda s, m=model, c=curve: c.append((s, evaluate(m)[metric])),
                                   callback_every=every)
            curves[name] = curve
    goal = curves["random"][-1][1]
    reach = {n: next((s for s, v in c if v >= goal), None) for n, c in curves.items()}
    ratio = (reach["parent"] / reach["random"]) if reach["parent"] is not None and reach["random"] else None
    return {"shape": "tiny", "metric": f"val/{metric}", "steps": steps, "parent_steps": parent_steps,
            "curves": curves,
            "goal (random at the end)": goal, "steps_to_goal": reach, "targets": {"ratio": 0.2},
            "summary": {f"val/{metric} random at end": f"{goal:.3f}",
                        "steps to reach it: random": str(reach["random"]),
                        "steps to reach it: from parent": str(reach["parent"]),
                        "ratio (parent/random)": f"{ratio:.2f} (target <= 0.2)" if ratio is not None else "n/a"}}
