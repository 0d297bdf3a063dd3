"""eagle-form-step: the training step of an EAGLE 3.1 drafter against the same drafter in the 3.0 form (its
``fc_norm`` RMSNorms before ``fc``, ``norm_output`` feeding the next step the post-norm state), interleaved in one
run, for the Kimi miniature's MLA layer and SmolLM2's Llama layer (the two shapes ``eagle-forms`` compares
served acceptance on). Same packed batch, seed, bf16, blockwise draft attention, a bare AdamW step (forward over
the TTT steps, backward, clip, step), one rank.
"""

from __future__ import annotations

import statistics

import torch

from benchmarks.common import bench_model, fake_batch
from benchmarks.drafter_layers import adamw_step, interleaved

SHAPES = {"kimi": "tiny-kimi-mla", "smollm2": "smollm2"}


def run(tokens: int = 512, iters: int = 6, rounds: int = 5) -> dict:
    """Every variant is built first; then ``rounds`` rounds of ``iters`` steps of each, the order rotated each
    round. Per shape, each round gives 3.1's median step over 3.0's; the result is the median ratio over rounds and
    its spread."""
    from draftline.drafter.form import EagleForm
    from draftline.drafter.model import loss_config

    forms = {"3.0": EagleForm(), "3.1": EagleForm(fc_norm=True, norm_output=True)}
    steps, params = {}, {}
    for label, shape in SHAPES.items():
        for form_name, form in forms.items():
            key = f"{label} {form_name}"
            torch.manual_seed(0)
            model = bench_model(shape, torch.device("cpu"), attn="blockwise", form=form)
            params[key] = sum(p.numel() for p in model.parameters() if p.requires_grad)
            steps[key] = adamw_step(model, fake_batch(model, tokens, torch.device("cpu")), loss_config())
            steps[key]()  # warm-up
    times, medians = interleaved(steps, iters=iters, rounds=rounds, sync=lambda: None)
    results, summary = {}, {}
    for label in SHAPES:
        per = [b / a for a, b in zip(medians[f"{label} 3.0"], medians[f"{label} 3.1"], strict=True)]
        for form_name in forms:
            key = f"{label} {form_name}"
            results[key] = {"trainable_params": params[key], "step_s_median": statistics.median(times[key]),
                            "tokens_per_s": tokens / statistics.median(times[key]), "step_s_all": times[key]}
        results[f"{label} 3.1 / 3.0"] = {"ratio": statistics.median(per), "per_round": per,
                                         "spread": [min(per), max(per)]}
        extra = params[f"{label} 3.1"] - params[f"{label} 3.0"]
        summary[f"{label}: 3.1 step time / 3.0"] = (
            f"x{statistics.median(per):.3f} [{min(per):.3f}, {max(per):.3f}] per round; 3.1 adds {extra:,} "
            f"trainable parameters ({100 * extra / params[f'{label} 3.0']:.2f} %)")
    return {"summary": summary, "shapes": SHAPES, "dtype": "bfloat16", "attention": "blockwise",
            "tokens_per_step": tokens, "iters": iters, "rounds": rounds,
            "method": "variants interleaved, order rotated each round; ratio = median over rounds of the round's "
                      "3.1 median step / 3.0's; spread = min..max over rounds", "steps": results}
