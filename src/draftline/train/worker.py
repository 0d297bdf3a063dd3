"""One DeepSpeed rank of a finetune. Started by the DeepSpeed launcher (``python -m draftline.train.worker
--spec SPEC.json``), never by hand; ``draftline finetune`` writes the spec and launches it.

Reads top to bottom: distributed init -> data -> model (bf16) -> parent weights -> DeepSpeed engine ->
resume -> loop (forward, backward, step, all-reduced metrics logged by rank 0) -> checkpoints.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from mlflow import MlflowClient
from mlflow.entities import Metric
from safetensors.torch import load_file

from draftline import names, tracking
from draftline.console import say
from draftline.data.shards import open_prepared
from draftline.data.verify import ShardVerifier
from draftline.drafter.batches import micro_steps, prefetch
from draftline.drafter.checkpoints import find_checkpoint, load_into_model
from draftline.drafter.handoff import BEST_TAG, read_best, write_best
from draftline.drafter.model import (
    accumulate,
    add_hidden_noise,
    build_draft_model,
    forward,
    loss_config,
    metric_sums,
    pack,
    summarise,
    trainable_parameters,
    trained_shares,
)
from draftline.drafter.vocab import VocabRemap, remap_lm_head, verifier_head
from draftline.errors import DraftlineError
from draftline.train.metrics_relay import MetricsFile
from draftline.train.signals import install_rank_handlers, stop_requested
from draftline.train.spec import WorkerSpec


def _log_metrics(client, run_id: str, metrics: dict[str, float], step: int) -> None:
    now = int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])


def _all_reduce_sums(sums: dict[str, float]) -> dict[str, float]:
    keys = sorted(sums)
    t = torch.tensor([sums[k] for k in keys], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return dict(zip(keys, t.tolist()))


def split_validation(records: list, fraction: float) -> tuple[list, list]:
    """Every k-th sample (k = round(1/fraction)) is held out; deterministic, independent of the seed."""
    if fraction <= 0 or len(records) < 2:
        return records, []
    k = max(2, round(1 / fraction))
    return ([r for i, r in enumerate(records) if i % k], [r for i, r in enumerate(records) if not i % k])


@torch.no_grad()
def validate(engine, val_records, spec, device, dtype, cfg, rank: int, world: int) -> dict[str, float]:
    """Metrics over the held-out samples, chunks split across ranks. Every rank runs the same number of
    forwards (ZeRO-3 gathers parameters collectively); surplus forwards are not counted."""
    engine.eval()
    sums = metric_sums(engine, val_records, ttt_steps=spec.config.ttt_steps, tokens_per_batch=spec.config.tokens_per_batch,
                       dtype=dtype, device=device, loss_cfg=cfg, rank=rank, world=world)
    return summarise(_all_reduce_sums(sums), spec.config.ttt_steps)


def main(argv: list[str] | None = None) -> NoReturn:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--spec", required=True)
    args = ap.parse_args(argv)
    spec = WorkerSpec.read(args.spec)
    error_file = Path(spec.error_file)
    try:
        train(spec)
    except SystemExit:  # a stop (SIGTERM/SIGINT) after saving: not an error
        raise
    except BaseException as e:  # the launcher only sees exit codes: leave the message for the parent
        # a user's error (e.g. a changed shard found by rank 1) is kept over the errors it causes in other ranks
        kept = json.loads(error_file.read_text()) if error_file.exists() else {}
        if not kept.get("draftline") and (isinstance(e, DraftlineError) or not kept
                                          or int(os.environ.get("RANK", "0")) == 0):
            msg = str(e) if isinstance(e, DraftlineError) else "".join(traceback.format_exception(e))
            error_file.write_text(json.dumps({"type": type(e).__name__, "message": msg,
                                              "draftline": isinstance(e, DraftlineError)}))
        raise
    finished()


def finished() -> NoReturn:
    """A rank whose training finished (its checkpoints saved, every rank past save_checkpoint's barrier, its
    metrics written file by file) ends here, skipping the interpreter's teardown: there, on CPUs, a native thread
    of the process group was seen to abort a finished rank ("terminate called without an active exception",
    exit -6: once in four 2-rank ZeRO-3 runs), and the launcher then failed a finished run."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(0)


def no_shm_allreduce() -> None:
    """Keep DeepSpeed's CPU all-reduce on gloo. Its shared-memory kernel (``deepspeed_shm_comm``) is compiled
    on first use (minutes on 2 cores, under a lock file that a killed rank leaves behind, hanging every later
    run) and creates a 66 MiB ``/dev/shm`` buffer per rank that it never unlinks: RAM lost for good on every
    CPU run. On a GPU it is not used at all."""
    import deepspeed.ops  # noqa: PLC0415 (deepspeed: slow, and prints an accelerator warning at import)

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def train(spec: WorkerSpec) -> None:
    """One rank's training: distributed init, data, model, engine, resume, then the step loop."""
    import deepspeed  # noqa: PLC0415 (deepspeed: slow, and prints an accelerator warning at import)

    on_gpu = torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "cuda") != "cpu"
    if not on_gpu:
        no_shm_allreduce()
    deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo")
    here = _place_rank(spec, on_gpu)
    records, val_records, shards = _open_data(spec, here)
    model = _build_model(spec, here)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trainable_parameters(model),
                                           config=spec.ds_config)
    ckpt_dir = Path(spec.checkpoint_dir)
    start_step = _resume(engine, ckpt_dir, here.rank)

    best = read_best(ckpt_dir)
    stop = install_rank_handlers()  # SIGTERM/SIGINT, or the launcher's stop file: save, then exit
    client, run_id = _metrics_sink(spec, here.rank)
    run = _Run(spec=spec, here=here, engine=engine, cfg=loss_config(), ckpt_dir=ckpt_dir, client=client,
               run_id=run_id, val_records=val_records)
    packed = _batch_stream(records, spec, here, start_step)
    if val_records and start_step == 0:  # the parent (or the random init), measured before it changes
        _log_start_validation(run)
    engine.train()
    _train_loop(run, packed, start_step, best, shards, stop)


@dataclass(frozen=True)
class _Rank:
    """Where this rank runs: its place among the ranks, its device, and the dtype it trains in."""

    rank: int
    world: int
    device: torch.device
    dtype: torch.dtype
    on_gpu: bool


@dataclass(frozen=True)
class _Run:
    """What the loop's steps share once the engine is built (``client`` None: this rank logs no metrics)."""

    spec: WorkerSpec
    here: _Rank
    engine: Any
    cfg: Any
    ckpt_dir: Path
    client: MetricsFile | MlflowClient | None
    run_id: str | None
    val_records: list


def _place_rank(spec: WorkerSpec, on_gpu: bool) -> _Rank:
    """This rank's number, world size and device (selected on a GPU); seeds torch and picks the dtype."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(f"cuda:{local_rank}") if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    torch.manual_seed(spec.config.seed)
    dtype = torch.bfloat16 if spec.config.precision == "bf16" else torch.float32
    return _Rank(rank=rank, world=world, device=device, dtype=dtype, on_gpu=on_gpu)


def _open_data(spec: WorkerSpec, here: _Rank) -> tuple[list, list, ShardVerifier]:
    """Training and validation records, and the verifier that hashes each shard once while training."""
    # every rank memory-maps the same shards and takes its own batches
    data = open_prepared(Path(spec.data_dir))
    shards = ShardVerifier(data, here.rank, here.world).start()  # each shard's sha256 once, while training
    if spec.eval_data_dir:  # a fixed evaluation set (checked whole before launch): every training sample trains
        records, val_records = data.records(), open_prepared(Path(spec.eval_data_dir)).records()
    else:
        records, val_records = split_validation(data.records(), spec.config.val_fraction)
    return records, val_records, shards


def _build_model(spec: WorkerSpec, here: _Rank) -> torch.nn.Module:
    """The drafter, on this rank's device: built, cast, then the parent's weights copied in (never under
    zero.Init; see docs/design.md)."""
    vocab = load_file(spec.vocab_file)
    model = build_draft_model(spec.verifier, d2t=vocab["d2t"], t2d=vocab["t2d"],
                              aux_layer_ids=spec.aux_layer_ids, draft_vocab_size=int(vocab["d2t"].numel()),
                              ttt_steps=spec.config.ttt_steps, attn_impl=spec.config.attn_impl, dtype=here.dtype,
                              layer=spec.layer)
    if spec.parent_path:
        parent_files = find_checkpoint(spec.parent_path, allow_pickle=spec.config.allow_pickle)
        remap = None
        if spec.config.vocab == "rebuild":  # the remap finetune planned (vocab.safetensors: new_rows_from_old)
            full_head = verifier_head(spec.verifier)
            plan = VocabRemap(new_rows_from_old=vocab["new_rows_from_old"], kept=-1, added=-1, dropped=-1)
            remap = lambda old: remap_lm_head(old, plan, vocab["d2t"], full_head)  # noqa: E731
        report = load_into_model(model, parent_files, lm_head_remap=remap)
        if here.rank == 0:
            Path(spec.load_report).write_text(json.dumps(report.__dict__, indent=2))
    model.to(here.device)
    return model


def _resume(engine, ckpt_dir: Path, rank: int) -> int:
    """The step to start at: the newest checkpoint's (loaded into ``engine``), else 0."""
    start_step = 0
    if (ckpt_dir / "latest").is_file():
        _, client_state = engine.load_checkpoint(str(ckpt_dir))
        start_step = int((client_state or {}).get("step", 0))
        if rank == 0:
            say(f"resumed from {ckpt_dir} at step {start_step}")
    return start_step


def _metrics_sink(spec: WorkerSpec, rank: int) -> tuple[MetricsFile | MlflowClient | None, str | None]:
    """``(client, run_id)``: rank 0 logs the metrics (spec.run_id None: no logging); other ranks get Nones."""
    run_id = spec.run_id if rank == 0 else None
    client = (MetricsFile(spec.metrics_file) if spec.metrics_file else tracking.client()) \
        if run_id else None  # metrics go through a file the launching process relays
    return client, run_id


def _batch_stream(records: list, spec: WorkerSpec, here: _Rank, start_step: int) -> Iterator[list[dict]]:
    """This rank's steps from ``start_step`` on, each its packed micro-batches, prepared on a background thread
    (pinned on a GPU)."""
    stream = micro_steps(records, spec.config.tokens_per_batch, spec.micro_batch_tokens, seed=spec.config.seed, rank=here.rank,
                         world_size=here.world, start_step=start_step)
    pin = (lambda b: {k: v.pin_memory() for k, v in b.items()}) if here.on_gpu else (lambda b: b)
    return prefetch([pin(pack(group)) for group in groups] for groups in stream)


def _validate(run: _Run) -> dict[str, float]:
    """:func:`validate` on this run's held-out records, engine and rank."""
    h = run.here
    return validate(run.engine, run.val_records, run.spec, h.device, h.dtype, run.cfg, h.rank, h.world)


def _log_start_validation(run: _Run) -> None:
    """Validation before the first step, logged at step 0 (and as ``parent.val/`` over a parent)."""
    val = _validate(run)
    if run.client and run.run_id:
        start = {f"val/{k}": v for k, v in val.items()}
        if run.spec.parent_path:
            start.update({f"parent.val/{k}": val[k] for k in ("acceptance_length", "full_acc_0") if k in val})
        _log_metrics(run.client, run.run_id, start, 0)


def _train_loop(run: _Run, packed: Iterator[list[dict]], start_step: int, best: dict | None, shards: ShardVerifier,
                stop: dict[str, bool]) -> None:
    """Steps until ``spec.config.steps``: train, log, validate, check shards, checkpoint; exits 143 on a stop, saved."""
    spec = run.spec
    steps = spec.config.steps
    step, tick = start_step, time.perf_counter()
    window_tokens = 0
    while step < steps:
        metrics, tokens = _train_step(run, next(packed))
        step += 1
        window_tokens += tokens
        if step % spec.config.log_every == 0 or step == steps:
            _log_train_window(run, metrics, window_tokens, tick, step)
            tick, window_tokens = time.perf_counter(), 0
        if run.val_records and (step % spec.config.val_every == 0 or step == steps):
            best = _validate_and_keep_best(run, best, step)
        if step == steps:
            shards.finish()  # a run does not end successfully before every shard was checked
        else:
            shards.check()
        stop["now"] = stop_requested(stop["now"], spec.stop_file)  # all ranks agree on the step to stop at
        if step % spec.config.save_every == 0 or step == steps or stop["now"]:
            _save_newest(run, step)
        if stop["now"]:
            if run.here.rank == 0:
                say(f"stop requested: saved step {step}")
            sys.exit(143)


def _train_step(run: _Run, packs: list[dict]) -> tuple[dict, int]:
    """One optimiser step over a step's micro-batches: each one's forward and backward, its loss weighted by its
    share of the trained tokens (the whole step's gradient, :func:`trained_shares`), DeepSpeed told the last one
    ends the accumulation; the step's summed metrics and its token count."""
    spec, device, dtype = run.spec, run.here.device, run.here.dtype
    summed: dict = {}
    tokens = 0
    for i, (share, batch) in enumerate(zip(trained_shares(packs), packs, strict=True)):
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        batch["hidden_states"] = batch["hidden_states"].to(dtype)
        batch["verifier_last_hidden_states"] = batch["verifier_last_hidden_states"].to(dtype)
        if spec.config.hidden_noise:
            batch["hidden_states"] = add_hidden_noise(batch["hidden_states"], spec.config.hidden_noise,
                                                      len(spec.aux_layer_ids))
        run.engine.set_gradient_accumulation_boundary(i == len(packs) - 1)
        loss, metrics = forward(run.engine, batch, spec.config.ttt_steps, run.cfg, ttt_loss_decay=spec.config.ttt_loss_decay)
        run.engine.backward(loss * share)
        for k, v in metrics.items():
            summed[k] = summed[k] + v.detach() if k in summed else v.detach()
        tokens += int(batch["input_ids"].numel())
    run.engine.step()
    return summed, tokens


def _log_train_window(run: _Run, metrics: dict, window_tokens: int, tick: float, step: int) -> None:
    """The last step's metrics and the window's throughput, all-reduced over the ranks and logged by rank 0."""
    sums = accumulate({"tokens": float(window_tokens)}, metrics)
    sums = _all_reduce_sums(sums)
    elapsed = time.perf_counter() - tick
    if run.client and run.run_id:
        summary = summarise(sums, run.spec.config.ttt_steps)
        out = {f"train/{k}": v for k, v in summary.items() if not k.startswith("tokens")}
        out["train/lr"] = run.engine.get_lr()[0]
        out[names.TRAIN_TOKENS_PER_S] = sums["tokens"] / max(elapsed, 1e-9)
        _log_metrics(run.client, run.run_id, out, step)


def _validate_and_keep_best(run: _Run, best: dict | None, step: int) -> dict | None:
    """Validation at ``step``, logged; a better acceptance length than ``best`` is saved as the best checkpoint.
    Returns the best so far."""
    val = _validate(run)
    if run.client and run.run_id:
        _log_metrics(run.client, run.run_id, {f"val/{k}": v for k, v in val.items()}, step)
    if best is None or val["acceptance_length"] > best["value"]:  # kept beside the newest
        best = {"step": step, "metric": names.VAL_ACCEPTANCE_LENGTH, "value": val["acceptance_length"]}
        run.engine.save_checkpoint(str(run.ckpt_dir), tag=BEST_TAG, client_state={"step": step, "best": best},
                                   save_latest=False)
        if run.here.rank == 0:
            write_best(run.ckpt_dir, best)
    run.engine.train()
    return best


def _save_newest(run: _Run, step: int) -> None:
    """Checkpoint ``step``; rank 0 then deletes the older step checkpoints (the best one is kept)."""
    run.engine.save_checkpoint(str(run.ckpt_dir), tag=f"step{step}", client_state={"step": step})
    if run.here.rank == 0:  # keep the newest checkpoint (and the best) only; save_checkpoint ends with a barrier
        for old in run.ckpt_dir.glob("step*"):
            if old.name != f"step{step}":
                shutil.rmtree(old, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
