"""The directory vLLM serves as it is (speculators' format for a Llama-family layer, vLLM's
``Eagle3DeepseekV2ForCausalLM`` one for an MLA layer: :mod:`draftline.drafter.served`), ``lineage.json`` and a
model card naming its base model; the verifier named by the id serving hosts load it by."""

from __future__ import annotations

import json
from pathlib import Path

from draftline import names
from draftline.config import ExportConfig
from draftline.drafter.aux_ids import served_ids_problem
from draftline.drafter.served import save_served, short_form
from draftline.errors import CheckpointError, DataError
from draftline.kinds import MLA, layer_kind
from draftline.registry.confidence import Interval
from draftline.registry.lineage import LINEAGE_FILE


def serving_id(cfg: ExportConfig, params: dict[str, str]) -> str:
    """The verifier as a serving host knows it (``vllm serve <pulled dir>`` loads it by this), never a path
    on the training host."""
    recorded = params.get(names.VERIFIER_NAME_OR_PATH, "")
    chosen = cfg.verifier_id or recorded
    if not chosen or Path(chosen).is_absolute() or chosen.startswith(("./", "../", "~")) or (
            chosen == params.get(names.VERIFIER_PATH) and not cfg.verifier_id):
        raise DataError(f"the finetune run recorded its verifier only as the path {recorded} on the training host, "
                        "which a serving host cannot load: pass --verifier-id ORG/NAME (the Hugging Face repo id "
                        "the serving hosts load it by), here or to prepare")
    return chosen


def evaluation_rows(evaluated: list[dict]) -> str:
    """One row per evaluation set the version was measured on: served acceptance and the speed-up the drafter
    bought, each with its interval, as evaluate measured them on vLLM."""
    rows = []
    for result in evaluated:
        m = result["metrics"]
        if names.MEASURED_ACCEPTANCE_LENGTH not in m:
            continue
        acc = f"{m[names.MEASURED_ACCEPTANCE_LENGTH]:.3f}"
        if names.MEASURED_LOW in m:
            acc += f" [{m[names.MEASURED_LOW]:.3f}, {m[names.MEASURED_HIGH]:.3f}]"
        speeds = sorted((int(k.split("/")[2][1:]), k.rsplit("/", 1)[0]) for k in m
                        if k.startswith("eval/speed/c") and k.endswith("/speedup"))
        speed = "; ".join(f"x{_speedup(m, p).text('wave')} at concurrency {c} ({m[p + '/drafted_tokens_per_s']:.1f} vs "
                          f"{m[p + '/plain_tokens_per_s']:.1f} tokens/s)" for c, p in speeds) or "not measured"
        prompts = int(m.get(names.MEASURED_PROMPTS, 0))
        rows.append(f"| {result['data']['name']} (`{result['data']['digest'][:12]}`) | {prompts} | {acc} | {speed} |")
    return "\n".join(rows)


def _speedup(m: dict[str, float], p: str) -> Interval:
    return Interval(m[p + "/speedup"], m[p + "/speedup_low"], m[p + "/speedup_high"],
                    m.get(names.MEASURED_CONFIDENCE, 0.95), int(m.get(p + "/waves", 2)))


def model_card(lineage: dict, metrics: dict[str, float], evaluated: list[dict] | None = None) -> str:
    base = lineage.get(names.PARENT_SOURCE) if lineage.get(names.PARENT_SOURCE) not in (None, "none") else \
        lineage.get(names.VERIFIER_NAME_OR_PATH)
    rows = "\n".join(f"| `{k}` | `{v}` |" for k, v in sorted(lineage.items()))
    mrows = "\n".join(f"| `{k}` | {v:.4f} |" for k, v in sorted(metrics.items()))
    relation = "base_model_relation: finetune\n" if lineage.get(names.PARENT_SOURCE) not in (None, "none") else ""
    erows = evaluation_rows(evaluated or [])
    evaluations = ("" if not erows else "\n## Measured by vLLM beside the verifier\n\nServed acceptance length and "
                   "tokens per second with the drafter over without it, on the same prompts (95% intervals; on the "
                   "hardware evaluate ran on, which is not necessarily yours).\n\n| evaluation set | prompts | "
                   "acceptance length | speed-up |\n|---|---|---|---|\n" + erows + "\n")
    return f"""---
base_model: {base}
{relation}license: other  # the parent's and the verifier's licenses apply
datasets: [draftline-data-{str(lineage.get(names.DATA_DIGEST, 'unknown'))[:12]}]
library_name: speculators
tags: [eagle3, speculative-decoding, draftline]
---
# EAGLE-3 drafter

Trained by draftline for the verifier `{lineage.get(names.VERIFIER_NAME_OR_PATH)}` on data set
`{lineage.get(names.DATA_DIGEST)}` (sha256 over its shards); serve it with vLLM, where that verifier loads by its id:

```
{serve_lines(lineage)}
```

## Lineage

| fact | value |
|---|---|
{rows}

## Metrics at the end of finetuning

| metric | value |
|---|---|
{mrows}
{evaluations}"""


def serve_lines(lineage: dict) -> str:
    """The serve lines of the model card: the short form where vLLM reads the verifier from the directory."""
    k = lineage.get(names.EVAL_RECOMMENDED_K, lineage.get(names.TTT_STEPS, 3))
    spec = f'''--speculative-config '{{"model": "<this dir>", "method": "eagle3", "num_speculative_tokens": {k}}}'''
    long = f"vllm serve {lineage.get(names.VERIFIER_NAME_OR_PATH)} {spec}"
    kind = layer_kind(lineage.get(names.DRAFTER_LAYER))
    if kind is MLA:
        return (f"{long} --dtype {kind.served_dtype}   # an MLA drafter ({kind.vllm_architecture}): vLLM's speculators "
                "reader knows no MLA layer, so the verifier is named here")
    return f"vllm serve <this dir>   # the verifier comes from speculators_config.verifier.name_or_path\n{long}"


def write_drafter(model, out: Path, lineage: dict, metrics: dict[str, float],
                  evaluated: list[dict] | None = None) -> None:
    """Write the directory vLLM serves (``checksums.json`` comes with the upload)."""
    save_served(model, out, lineage[names.VERIFIER_NAME_OR_PATH])
    cfg = json.loads((out / "config.json").read_text())
    for key in ("draft_vocab_size", "target_hidden_size"):
        if cfg.get(key) is None:
            raise CheckpointError(f"the exported config.json lacks {key}; vLLM would fall back to defaults")
    problem = served_ids_problem(cfg)
    if problem:
        raise CheckpointError(f"the exported config.json: {problem}")
    if short_form(cfg) and not (cfg.get("speculators_config") or {}).get("verifier", {}).get("name_or_path"):
        raise CheckpointError("the exported config.json names no verifier")
    if "quantization_config" in cfg or "quantization_config" in (cfg.get("transformer_layer_config") or {}):
        raise CheckpointError("the exported config.json carries a quantization_config: vLLM would load the "
                              "drafter as quantized")
    (out / LINEAGE_FILE).write_text(json.dumps(lineage, indent=2, sort_keys=True) + "\n")
    (out / "README.md").write_text(model_card(lineage, metrics, evaluated))
