"""What each stage hands back: a typed result the CLI prints as JSON (``draftline … | jq``) and the next step reads
(``main`` chains the stages by these run ids and the version export registered).

The JSON a command prints is :meth:`Result.to_json`: the fields by name, an absent optional part left out.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Result:
    """A stage's result: printed as JSON, read by attribute."""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.metadata.get("flatten"):
                out.update(value.to_json() if value is not None else {})
            elif value is not None or not f.metadata.get("omit_none"):
                out[f.name] = value.to_json() if isinstance(value, Result) else value
        return out


def _optional(**kw) -> Any:
    return field(default=None, metadata={"omit_none": True}, **kw)


@dataclass(frozen=True)
class PrepareResult(Result):
    """prepare: the data run and where its data lie."""

    run_id: str
    data_uri: str  # runs:/<run_id>/data: what finetune --data and evaluate --data take
    digest: str
    location: str


@dataclass(frozen=True)
class FinetuneResult(Result):
    """finetune: the run and the weights it handed on."""

    run_id: str
    weights_uri: str  # runs:/<run_id>/weights: what export and evaluate --target read
    checkpoint: str  # which checkpoint was handed on, and its step


@dataclass(frozen=True)
class NodeResult(Result):
    """finetune on a node other than node 0: the job's run, which node 0 logs."""

    run_id: str | None
    node_rank: str


@dataclass(frozen=True)
class Measured(Result):
    """What real speculative decoding accepted, where evaluate measured it."""

    measured_acceptance_length: float
    acceptance_rate_per_position: list[float]
    lossless: bool | None  # None: not checked
    prompts: int
    backend: str
    recommended_num_speculative_tokens: int
    recommended_from: str
    predicted_acceptance_length: float | None = _optional()
    inprocess_acceptance_length: float | None = _optional()
    measured_interval: list[float] | None = _optional()
    confidence: float | None = _optional()
    speedup: dict[str, list[float]] | None = _optional()
    sweep: dict[str, dict[str, list[float]]] | None = _optional()


@dataclass(frozen=True)
class EvaluateResult(Result):
    """evaluate: the evaluation run, teacher-forced figures, and the measured ones where measured."""

    run_id: str
    target: str
    data: str
    teacher_forced_acceptance_length: float
    teacher_forced_walk_acceptance_length: float
    measured: Measured | None = field(default=None, metadata={"flatten": True})


@dataclass(frozen=True)
class ExportResult(Result):
    """export: the export run and the version it registered."""

    run_id: str
    model_uri: str  # models:/NAME/VERSION
    version: str


@dataclass(frozen=True)
class MainResult(Result):
    """main: the three steps' runs and the version the chain registered."""

    prepare_run_id: str
    finetune_run_id: str
    export_run_id: str
    model_version: str
