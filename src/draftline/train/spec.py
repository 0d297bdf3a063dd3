"""What the launcher hands every rank: one typed, validated spec (``worker_spec.json``), written by finetune
and read by ``draftline.train.worker``. Finetune's logged params are derived from the same resolved values."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from draftline.config import FinetuneConfig


class WorkerSpec(BaseModel):
    """The stage's own settings (``config``: precision and attention resolved) and what finetune derived from
    them and from its inputs; nothing here repeats a setting."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    config: FinetuneConfig = Field(description="finetune's settings, `auto` precision and attention resolved.")
    run_id: str | None = Field(description="The MLflow run rank 0 logs metrics to (None: no logging).")
    data_dir: str = Field(description="Prepared data (manifest.json and shards), --data resolved.")
    verifier: str = Field(description="The verifier the data was captured from.")
    aux_layer_ids: list[int]
    layer: dict[str, Any] = Field(description="The drafter's decoder-layer config (drafter_shape.layer_config).")
    vocab_file: str = Field(description="d2t/t2d of the run's draft vocabulary (safetensors).")
    parent_path: str | None = Field(None, description="The parent's directory, --init resolved; None for a random "
                                    "init.")
    micro_batch_tokens: int = Field(ge=1, description="Tokens per micro-batch (--micro-batch-tokens 0 resolved).")
    eval_data_dir: str | None = Field(None, description="--eval-data resolved: a fixed evaluation set validated on "
                                      "instead of a held-out slice of the training data.")
    ds_config: dict[str, Any] = Field(description="The resolved DeepSpeed config the engine is built from.")
    checkpoint_dir: str
    load_report: str = Field(description="Where rank 0 writes the parent-load report (JSON).")
    error_file: str = Field(description="Where a failing rank leaves its message for the launcher.")
    stop_file: str | None = Field(None, description="Written by the launching process to ask the ranks to save "
                                  "and stop (train.signals).")
    metrics_file: str | None = Field(None, description="Where rank 0 appends its metrics (JSONL); the launching "
                                     "process relays them to MLflow (train.metrics_relay).")

    def write(self, path: Path) -> Path:
        path.write_text(self.model_dump_json(indent=2))
        return path

    @classmethod
    def read(cls, path: Path | str) -> WorkerSpec:
        return cls.model_validate_json(Path(path).read_text())
