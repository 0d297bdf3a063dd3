"""One DeepSpeed rank of a finetune. Started by the DeepSpeed launcher (``python -m draftline.train.worker
--spec SPEC.json``), never by hand; ``draftline finetune`` writes the spec and launches it.

Reads top to bottom: distributed init -> data -> model (bf16) -> parent weights -> DeepSpeed engine ->
resume -> loop (forward, backward, step, all-reduced metrics logged by rank 0) -> checkpoints.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from mlflow import MlflowClient
from mlflow.entities import Metric
from safetensors.torch import load_file

from draftline.console import say
from draftline.data.shards import open_prepared
from draftline.data.verify import ShardVerifier
from draftline.drafter.batches import batches, prefetch
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
    sums = metric_sums(engine, val_records, ttt_steps=spec.ttt_steps, tokens_per_batch=spec.tokens_per_batch,
                       dtype=dtype, device=device, loss_cfg=cfg, rank=rank, world=world)
    return summarise(_all_reduce_sums(sums), spec.ttt_steps)


def main(argv: list[str] | None = None) -> int:
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
    return 0


def no_shm_allreduce() -> None:
    """Keep DeepSpeed's CPU all-reduce on gloo. Its shared-memory kernel (``deepspeed_shm_comm``) is compiled
    on first use (minutes on 2 cores, under a lock file that a killed rank leaves behind, hanging every later
    run) and creates a 66 MiB ``/dev/shm`` buffer per rank that it never unlinks: RAM lost for good on every
    CPU run. On a GPU it is not used at all."""
    import deepspeed.ops  # noqa: PLC0415 (deepspeed: slow, and prints an accelerator warning at import)

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def train(spec: WorkerSpec) -> None:  # noqa: C901  (the training loop in one place, as nanoGPT keeps it)
    import deepspeed  # noqa: PLC0415 (deepspeed: slow, and prints an accelerator warning at import)

    on_gpu = torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "cuda") != "cpu"
    if not on_gpu:
        no_shm_allreduce()
    deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo")
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(f"cuda:{local_rank}") if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    torch.manual_seed(spec.seed)
    dtype = torch.bfloat16 if spec.precision == "bf16" else torch.float32

    # data: every rank memory-maps the same shards and takes its own batches
    data = open_prepared(Path(spec.data_dir))
    shards = ShardVerifier(data, rank, world).start()  # each shard's sha256 once, while training
    if spec.eval_data_dir:  # a fixed evaluation set (checked whole before launch): every training sample trains
        records, val_records = data.records(), open_prepared(Path(spec.eval_data_dir)).records()
    else:
        records, val_records = split_validation(data.records(), spec.val_fraction)

    # model: built, cast, then the parent's weights copied in (never under zero.Init; see docs/design.md)
    vocab = load_file(spec.vocab_file)
    model = build_draft_model(spec.verifier, d2t=vocab["d2t"], t2d=vocab["t2d"],
                              aux_layer_ids=spec.aux_layer_ids, draft_vocab_size=int(vocab["d2t"].numel()),
                              ttt_steps=spec.ttt_steps, attn_impl=spec.attn_impl, dtype=dtype,
                              layer=spec.layer)
    if spec.parent_path:
        parent_files = find_checkpoint(spec.parent_path, allow_pickle=spec.allow_pickle)
        remap = None
        if spec.vocab_policy == "rebuild":  # the remap finetune planned (vocab.safetensors: new_rows_from_old)
            full_head = verifier_head(spec.verifier)
            plan = VocabRemap(new_rows_from_old=vocab["new_rows_from_old"], kept=-1, added=-1, dropped=-1)
            remap = lambda old: remap_lm_head(old, plan, vocab["d2t"], full_head)  # noqa: E731
        report = load_into_model(model, parent_files, lm_head_remap=remap)
        if rank == 0:
            Path(spec.load_report).write_text(json.dumps(report.__dict__, indent=2))
    model.to(device)

    ds_config = spec.ds_config
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trainable_parameters(model),
                                           config=ds_config)
    ckpt_dir = Path(spec.checkpoint_dir)
    start_step = 0
    if (ckpt_dir / "latest").is_file():
        _, client_state = engine.load_checkpoint(str(ckpt_dir))
        start_step = int((client_state or {}).get("step", 0))
        if rank == 0:
            say(f"resumed from {ckpt_dir} at step {start_step}")

    best = read_best(ckpt_dir)
    stop = install_rank_handlers()  # SIGTERM/SIGINT, or the launcher's stop file: save, then exit
    run_id = spec.run_id if rank == 0 else None  # rank 0 logs the metrics (spec.run_id None: no logging)
    client = (MetricsFile(spec.metrics_file) if spec.metrics_file else MlflowClient()) \
        if run_id else None  # metrics go through a file the launching process relays
    cfg = loss_config()
    steps, ttt = spec.steps, spec.ttt_steps
    stream = batches(records, spec.tokens_per_batch, seed=spec.seed, rank=rank, world_size=world,
                     start_step=start_step)
    pin = (lambda b: {k: v.pin_memory() for k, v in b.items()}) if on_gpu else (lambda b: b)
    packed = prefetch(pin(pack(records_of_step)) for records_of_step in stream)
    if val_records and start_step == 0:  # the parent (or the random init), measured before it changes
        val = validate(engine, val_records, spec, device, dtype, cfg, rank, world)
        if client and run_id:
            start = {f"val/{k}": v for k, v in val.items()}
            if spec.parent_path:
                start.update({f"parent.val/{k}": val[k] for k in ("acceptance_length", "full_acc_0") if k in val})
            _log_metrics(client, run_id, start, 0)
    engine.train()
    step, tick = start_step, time.perf_counter()
    window_tokens = 0
    while step < steps:
        batch = {k: v.to(device, non_blocking=True) for k, v in next(packed).items()}
        batch["hidden_states"] = batch["hidden_states"].to(dtype)
        batch["verifier_last_hidden_states"] = batch["verifier_last_hidden_states"].to(dtype)
        if spec.hidden_noise:
            batch["hidden_states"] = add_hidden_noise(batch["hidden_states"], spec.hidden_noise,
                                                      len(spec.aux_layer_ids))
        loss, metrics = forward(engine, batch, ttt, cfg, ttt_loss_decay=spec.ttt_loss_decay)
        engine.backward(loss)
        engine.step()
        step += 1
        window_tokens += int(batch["input_ids"].numel())
        if step % spec.log_every == 0 or step == steps:
            sums = accumulate({"tokens": float(window_tokens)}, metrics)
            sums = _all_reduce_sums(sums)
            elapsed = time.perf_counter() - tick
            if client and run_id:
                out = {f"train/{k}": v for k, v in summarise(sums, ttt).items() if not k.startswith("tokens")}
                out["train/lr"] = engine.get_lr()[0]
                out["train/tokens_per_s"] = sums["tokens"] / max(elapsed, 1e-9)
                _log_metrics(client, run_id, out, step)
            tick, window_tokens = time.perf_counter(), 0
        if val_records and (step % spec.val_every == 0 or step == steps):
            val = validate(engine, val_records, spec, device, dtype, cfg, rank, world)
            if client and run_id:
                _log_metrics(client, run_id, {f"val/{k}": v for k, v in val.items()}, step)
            if best is None or val["acceptance_length"] > best["value"]:  # kept beside the newest
                best = {"step": step, "metric": "val/acceptance_length", "value": val["acceptance_length"]}
                engine.save_checkpoint(str(ckpt_dir), tag=BEST_TAG, client_state={"step": step, "best": best},
                                       save_latest=False)
                if rank == 0:
                    write_best(ckpt_dir, best)
            engine.train()
        if step == steps:
            shards.finish()  # a run does not end successfully before every shard was checked
        else:
            shards.check()
        stop["now"] = stop_requested(stop["now"], spec.stop_file)  # all ranks agree on the step to stop at
        if step % spec.save_every == 0 or step == steps or stop["now"]:
            engine.save_checkpoint(str(ckpt_dir), tag=f"step{step}", client_state={"step": step})
            if rank == 0:  # keep the newest checkpoint (and the best) only; save_checkpoint ends with a barrier
                for old in ckpt_dir.glob("step*"):
                    if old.name != f"step{step}":
                        shutil.rmtree(old, ignore_errors=True)
        if stop["now"]:
            if rank == 0:
                say(f"stop requested: saved step {step}")
            sys.exit(143)


if __name__ == "__main__":
    sys.exit(main())
