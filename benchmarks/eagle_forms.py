"""eagle-forms: EAGLE 3.0 or 3.1 for a Kimi drafter, judged by what vLLM serves. After ``./demo_kimi.sh`` (its
vLLM-answered, vLLM-captured training data and held-out evaluation set in ``mlflow.db``), two MLA drafters are
finetuned from random init at equal data, steps, seed, draft vocabulary and recipe, one in the 3.0 form and one in
the 3.1 form (``--fc-norm true --norm-output true``: an RMSNorm per aux hidden state before ``fc``, the post-norm
state fed to the next step); each is evaluated by vLLM beside the Kimi-shaped verifier on the same prompts: served
acceptance with its interval, the paired difference 3.1 minus 3.0 prompt by prompt, tokens/s with and without the
drafter, trained parameters and the training step's tokens/s. What it decides: ``--fc-norm``/``--norm-output``'s
default from random init (docs/kimi.md, "EAGLE 3.1").
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks.layers_served import compare, cpu_has_amx, summarize

FORMS = {"3.0": ["--fc-norm", "false", "--norm-output", "false"], "3.1": ["--fc-norm", "true", "--norm-output", "true"]}
LABEL = "3.1 - 3.0"


def run(shape: str = "kimi", steps: int = 100, seed: int = 0, max_new_tokens: int = 24, concurrency: str = "1") -> dict:
    layer = "mla" if shape == "kimi" else "llama"  # SmolLM2: its own Llama layer, speculators' Eagle3DraftModel's
    sides, paired, data, evalset = compare({form: ["--init", "random", "--drafter-layer", layer, *flags]
                                            for form, flags in FORMS.items()}, steps=steps, seed=seed,
                                           max_new_tokens=max_new_tokens, concurrency=concurrency, shape=shape)
    recipe = ("MLA drafters from random init, the same vLLM-answered data, steps, seed, draft vocabulary 256, lr "
              "3e-3, ZeRO-2 on 2 CPU ranks, only the EAGLE form differing; evaluate on vLLM (bf16)") if shape == "kimi" \
        else ("SmolLM2's own Llama-layer drafters from random init on demo_real.sh's team GSM8K data (answered by "
              "SmolLM2 through vLLM), the same steps, seed, draft vocabulary 8192, lr 1e-3, 1024 tokens per rank, 2 "
              "CPU ranks, only the EAGLE form differing; evaluate on vLLM (float32)")
    return {"summary": summarize(sides, paired, LABEL), "shape": shape, "sides": sides, "paired_31_minus_30": paired,
            "steps": steps, "seed": seed, "data": data, "evaluation_set": evalset, "max_new_tokens": max_new_tokens,
            "concurrency": concurrency, "amx": cpu_has_amx(),
            "method": recipe + " on the same held-out prompts, k=3; intervals: bootstrap over prompts (95%), paired "
                      "by prompt for the difference"}


if __name__ == "__main__":  # rewrite a result's summary from its figures
    path = Path(sys.argv[1])
    result = json.loads(path.read_text())
    result["summary"] = summarize(result["sides"], result["paired_31_minus_30"], LABEL)
    path.write_text(json.dumps(result, indent=2) + "\n")
