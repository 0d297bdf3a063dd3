"""The directory vLLM serves as it is: speculators' ``config.json`` and ``model.safetensors``, ``lineage.json``
and a model card naming its base model; the verifier named by the id serving hosts load it by."""

from __future__ import annotations

import json
from pathlib import Path

from draftline.config import ExportConfig
from draftline.errors import CheckpointError, DataError
from draftline.registry.lineage import LINEAGE_FILE


def serving_id(cfg: ExportConfig, params: dict[str, str]) -> str:
    """The verifier as a serving host knows it (``vllm serve <pulled dir>`` loads it by this), never a path
    on the training host."""
    recorded = params.get("verifier.name_or_path", "")
    chosen = cfg.verifier_id or recorded
    if not chosen or Path(chosen).is_absolute() or chosen.startswith(("./", "../", "~")) or (
            chosen == params.get("verifier.path") and not cfg.verifier_id):
        raise DataError(f"the finetune run recorded its verifier only as the path {recorded} on the training host, "
                        "which a serving host cannot load: pass --verifier-id ORG/NAME (the Hugging Face repo id "
                        "the serving hosts load it by), here or to prepare")
    return chosen


def model_card(lineage: dict, metrics: dict[str, float]) -> str:
    base = lineage.get("parent.source") if lineage.get("parent.source") not in (None, "none") else \
        lineage.get("verifier.name_or_path")
    rows = "\n".join(f"| `{k}` | `{v}` |" for k, v in sorted(lineage.items()))
    mrows = "\n".join(f"| `{k}` | {v:.4f} |" for k, v in sorted(metrics.items()))
    relation = "base_model_relation: finetune\n" if lineage.get("parent.source") not in (None, "none") else ""
    return f"""---
base_model: {base}
{relation}license: other  # the parent's and the verifier's licenses apply
datasets: [draftline-data-{str(lineage.get('data.digest', 'unknown'))[:12]}]
library_name: speculators
tags: [eagle3, speculative-decoding, draftline]
---
# EAGLE-3 drafter

Trained by draftline for the verifier `{lineage.get('verifier.name_or_path')}` on data set
`{lineage.get('data.digest')}` (sha256 over its shards); serve it with vLLM, where that verifier loads by its id:

```
vllm serve <this dir>   # the verifier comes from speculators_config.verifier.name_or_path
vllm serve {lineage.get('verifier.name_or_path')} --speculative-config '{{"model": "<this dir>", "method": "eagle3", "num_speculative_tokens": {lineage.get('eval.recommended_num_speculative_tokens', lineage.get('ttt_steps', 3))}}}'
```

## Lineage

| fact | value |
|---|---|
{rows}

## Metrics at the end of finetuning

| metric | value |
|---|---|
{mrows}
"""


def write_drafter(model, out: Path, lineage: dict, metrics: dict[str, float]) -> None:
    """Write the speculators-format directory (``checksums.json`` comes with the upload)."""
    out.mkdir(parents=True, exist_ok=True)
    model.config.target_hidden_size = model.hidden_size
    model.save_pretrained(str(out), safe_serialization=True)
    cfg = json.loads((out / "config.json").read_text())
    for key in ("eagle_aux_hidden_state_layer_ids", "draft_vocab_size", "target_hidden_size"):
        if cfg.get(key) is None:
            raise CheckpointError(f"the exported config.json lacks {key}; vLLM would fall back to defaults")
    if not (cfg.get("speculators_config") or {}).get("verifier", {}).get("name_or_path"):
        raise CheckpointError("the exported config.json names no verifier")
    (out / LINEAGE_FILE).write_text(json.dumps(lineage, indent=2, sort_keys=True) + "\n")
    (out / "README.md").write_text(model_card(lineage, metrics))
