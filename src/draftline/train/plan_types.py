"""The plan's shape: what :func:`draftline.train.plan.make_plan` returns, what ``draftline plan`` renders and
``--json`` prints, and what finetune logs as ``plan.json``. Typed dicts, so the plan stays the JSON it is and every
key read is checked (mypy)."""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict


class LayerSize(TypedDict):
    name: str
    params: int


class Activations(TypedDict):
    """An estimate of one forward+backward's activation memory (:func:`~draftline.train.plan.activation_bytes`)."""

    bytes: int
    bytes_per_token: int
    quadratic: int
    attn_impl: str
    formula: str
    per_step: int
    kv_cache: int
    once: int
    transient: int


class StageMemory(TypedDict):
    """Per-GPU bytes of one ZeRO stage, and whether it fits."""

    model_states: int
    frozen: int
    source: str  # where the model states' number is from (DeepSpeed's estimator, or the formula)
    activations: int
    total: int
    fits: bool | None  # None: the GPU's memory was not given
    headroom: int | None
    max_tokens_per_batch: NotRequired[int]  # where it does not fit: the most tokens per batch that would
    min_gpus: NotRequired[int | None]  # and the fewest GPUs that would


class Plan(TypedDict):
    drafter: str
    params: int
    trainable: int
    frozen: int
    checkpoint_params: int
    checkpoint_params_with_embeddings: int
    frozen_names: list[str]
    largest_layer: LayerSize
    largest_frozen_layer: LayerSize
    shape: dict[str, Any]
    gpus_per_node: int
    nodes: int
    gpu_memory_gib: float | None
    margin: float
    budget_bytes: int | None
    tokens_per_batch: int
    ttt_steps: int
    precision: str
    zero_stage: int | None
    activations: Activations
    stages: dict[str, StageMemory]  # "0" … "3"
    fits: bool | None
    deepspeed_estimators: str
    interconnect: dict[str, Any]  # train/interconnect.py: the link's traffic per stage
    recommended_stage: int | None
    recommended_because: str
    verifier: str | None
    run: dict[str, Any]  # train/phases.py: the run's phases and their times
    storage: dict[str, Any]  # data/storage.py: the shards prepare writes
