"""evaluation: measured acceptance on the tiny verifier. Throughput of ``measure_chain`` (prompts/s, generated
tok/s) beside the verifier's own greedy ``generate`` on the same prompts, and measured acceptance (real greedy
chain speculative decoding, vLLM's counters) beside teacher-forced acceptance on the same samples.

The drafter is trained (bare AdamW, fp32) on the verifier's greedy replies to demo prompts and judged on the
replies to other prompts; one torch thread (two spin against each other on this shared 2-core machine).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
AUX = [2, 4, 5]


def run(train_prompts: int = 128, eval_prompts: int = 16, new_tokens: int = 48, steps: int = 150,
        ks: tuple[int, ...] = (1, 3, 5)) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftline.evaluation.chain import measure_chain, recommend_num_speculative_tokens
    from draftline.testing.tiny import make_tiny
    from tests.kit import greedy

    torch.set_num_threads(1)
    demo = ROOT / "configs" / "demo" / "conversations.jsonl"
    with tempfile.TemporaryDirectory(prefix="draftline-eval-") as tmp:
        tiny = make_tiny(Path(tmp), demo, parent_steps=0, progress=False)
        tok = AutoTokenizer.from_pretrained(tiny["verifier"])
        verifier = AutoModelForCausalLM.from_pretrained(tiny["verifier"], dtype=torch.float32).eval()
        prompts = greedy.chat_prompts(tok, demo, train_prompts + eval_prompts)
        train, held_out = prompts[:train_prompts], prompts[train_prompts:]
        recs = greedy.records(verifier, train, greedy.greedy_replies(verifier, train, new_tokens, tok.pad_token_id),
                              AUX)
        drafter = greedy.train_drafter(tiny["verifier"], recs, aux_layer_ids=AUX, steps=steps)
        replies = greedy.greedy_replies(verifier, held_out, new_tokens, tok.pad_token_id)
        forced = greedy.teacher_forced(drafter, greedy.records(verifier, held_out, replies, AUX))

        start = time.perf_counter()  # the verifier alone, one prompt at a time, as measure_chain decodes
        with torch.inference_mode():
            plain_tokens = sum(verifier.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                                 do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                                 pad_token_id=tok.pad_token_id).shape[1] - len(p) for p in held_out)
        plain_s = time.perf_counter() - start

        measured = {k: measure_chain(verifier, drafter, held_out, k=k, max_new_tokens=new_tokens) for k in ks}

    rows = {f"k={k}": {**{n: round(v, 4) for n, v in r.metrics().items()},
                       "mismatches": r.mismatches} for k, r in measured.items()}
    longest = measured[max(ks)]
    best_k = recommend_num_speculative_tokens(longest.per_position_rates)
    summary = {
        "verifier generate (1 prompt at a time)": f"{plain_tokens / plain_s:.1f} tok/s, "
                                                  f"{len(held_out) / plain_s:.2f} prompts/s",
        **{f"measure_chain k={k}": f"{r.metrics()['tokens_per_s']:.1f} tok/s, {r.metrics()['prompts_per_s']:.2f} "
                                   f"prompts/s, acceptance length {r.acceptance_length:.3f}, lossless {r.lossless}"
           for k, r in measured.items()},
        "teacher-forced (ttt 3)": f"acceptance length {forced['acceptance_length']:.3f}, full_acc_0 "
                                   f"{forced['full_acc_0']:.3f}, full-vocabulary acc_0 {forced['full_vocab_acc_0']:.3f}",
        "measured position-1 rate (k=1)": f"{measured[min(ks)].per_position_rates[0]:.3f}" if min(ks) == 1 else "-",
        f"recommended k (from k={max(ks)}, draft cost 0.05)": best_k,
    }
    return {"shape": "tiny", "threads": 1, "train_prompts": train_prompts, "eval_prompts": eval_prompts,
            "new_tokens": new_tokens, "train_steps": steps,
            "teacher_forced": {n: round(v, 4) for n, v in forced.items()},
            "verifier_generate": {"tokens_per_s": round(plain_tokens / plain_s, 2),
                                  "prompts_per_s": round(len(held_out) / plain_s, 3)},
            "measured": rows, "recommended_num_speculative_tokens": best_k, "summary": summary}
