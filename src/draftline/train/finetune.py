"""The finetune stage: resolve data and parent, record lineage, launch DeepSpeed ranks, log the checkpoint.

Everything a rank needs goes into one spec file; the ranks (``draftline.train.worker``) only train. The
parent's layout, hash, vocabulary and aux layers are checked here, before any rank starts.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import mlflow
import torch
from safetensors.torch import save_file

from draftline import names, tracking
from draftline.config import FinetuneConfig, work_dir
from draftline.console import say
from draftline.data.refs import dataset_name, resolve_data
from draftline.data.shards import PreparedData, open_prepared
from draftline.drafter import attention, form, handoff
from draftline.drafter.checkpoints import CheckpointFiles, detect_layout, draft_vocab, find_checkpoint, read_header
from draftline.drafter.form import split as split_form
from draftline.drafter.form import with_form
from draftline.drafter.model import LAYER_FILE, PAIRING
from draftline.drafter.parents import Parent, aux_reads, resolve_init
from draftline.drafter.shape import key_remap, layer_config, layer_kind, verifier_config
from draftline.drafter.vocab import build_vocab, plan_remap
from draftline.errors import CheckpointError, DataError
from draftline.registry import lineage
from draftline.results import FinetuneResult, NodeResult
from draftline.serving import hf_model
from draftline.tracking import log_params_once, tracking_uri
from draftline.train import job, precision, preflight
from draftline.train import plan as planning
from draftline.train.charts import log_accuracy_chart
from draftline.train.inputs import check_visible, ds_config_path, job_place, read_ds_config_file
from draftline.train.launcher import gpu_memory_gib, hostfile_shape, launch, resolve_ranks
from draftline.train.nodes import Place
from draftline.train.signals import stop_on_signals
from draftline.train.spec import WorkerSpec
from draftline.util import files_digest


def ds_config(cfg: FinetuneConfig) -> dict:
    """The DeepSpeed config the ranks run: the file with finetune's settings filled in (checked as a whole by
    DeepSpeed's own config class in ``preflight.check_ds_config``)."""
    conf = read_ds_config_file(ds_config_path(cfg))
    conf = {k: v for k, v in conf.items() if not k.startswith("_")}
    conf["zero_optimization"] = {**conf.get("zero_optimization", {}), "stage": cfg.zero_stage}
    conf["bf16"] = {"enabled": cfg.precision == "bf16"}
    conf["gradient_clipping"] = cfg.grad_clip
    opt = conf.setdefault("optimizer", {"type": "AdamW", "params": {}})
    opt["params"].update({"lr": cfg.lr, "weight_decay": cfg.weight_decay})
    conf["scheduler"] = lr_scheduler(cfg)
    return conf


def micro_batch_tokens(cfg: FinetuneConfig) -> int:
    """The most tokens a rank's micro-batch holds: as asked (at most the step), or the whole step for 0."""
    return min(cfg.micro_batch_tokens or cfg.tokens_per_batch, cfg.tokens_per_batch)


def lr_scheduler(cfg: FinetuneConfig) -> dict:
    """DeepSpeed's own scheduler for ``lr_schedule``: linear warm-up, then linear decay to 0 (WarmupDecayLR),
    cosine decay to 0 (WarmupCosineLR, which scales the optimiser's lr) or the peak held (WarmupLR)."""
    warmup = max(1, min(cfg.warmup_steps, cfg.steps))  # DeepSpeed's schedulers need >= 1 warm-up step
    total = max(cfg.steps, warmup + 1)
    if cfg.lr_schedule == "cosine":
        return {"type": "WarmupCosineLR", "params": {"total_num_steps": total, "warmup_min_ratio": 0.0,
                                                     "warmup_num_steps": warmup, "cos_min_ratio": 0.0,
                                                     "warmup_type": "linear"}}
    ramp = {"warmup_min_lr": 0.0, "warmup_max_lr": cfg.lr, "warmup_num_steps": warmup, "warmup_type": "linear"}
    if cfg.lr_schedule == "constant":
        return {"type": "WarmupLR", "params": ramp}
    return {"type": "WarmupDecayLR", "params": {**ramp, "total_num_steps": total}}


def optimizer_params(conf: dict) -> dict[str, object]:
    """The optimiser's settings as the resolved DeepSpeed config runs them (a custom ``--ds-config`` included)."""
    opt = conf.get("optimizer") or {}
    p = opt.get("params") or {}
    sched = (conf.get("scheduler") or {}).get("params") or {}
    return {"optimizer.name": opt.get("type", "none"), names.OPTIMIZER_LR: p.get("lr"),
            "optimizer.betas": tuple(p["betas"]) if "betas" in p else None, "optimizer.eps": p.get("eps"),
            "optimizer.weight_decay": p.get("weight_decay"),
            names.OPTIMIZER_WARMUP_STEPS: sched.get("warmup_num_steps"),
            "optimizer.schedule": (conf.get("scheduler") or {}).get("type", "none"),
            "optimizer.grad_clip": conf.get("gradient_clipping")}


def choose_vocab(cfg: FinetuneConfig, files, data, verifier_vocab: int) -> tuple[dict, dict[str, int]]:
    """``({"d2t", "t2d"}, counts)`` by the vocabulary policy; a rebuilt vocabulary over a parent's also carries
    ``new_rows_from_old`` (the remap planned here, once: the ranks apply it to the parent's ``lm_head``)."""
    parent_vocab = draft_vocab(files, verifier_vocab) if files else {}
    if files:
        d2t, t2d = parent_vocab["d2t"], parent_vocab["t2d"]
        if d2t.dtype != torch.long or t2d.dtype != torch.bool:
            raise CheckpointError(f"parent d2t/t2d have dtypes {d2t.dtype}/{t2d.dtype}; expected int64/bool")
        if t2d.numel() != verifier_vocab:
            raise CheckpointError(f"t2d: parent [{t2d.numel()}], verifier vocabulary {verifier_vocab} — parent "
                                  "made for a verifier with another vocabulary?")
        if int(t2d.sum()) != d2t.numel():
            raise CheckpointError(f"parent t2d marks {int(t2d.sum())} tokens but d2t has {d2t.numel()} rows")
    if files and cfg.vocab == "parent":
        n = int(d2t.numel())
        return {"d2t": d2t, "t2d": t2d}, {"draft_size": n, "kept": n, "added": 0, "dropped": 0}
    size = cfg.draft_vocab_size or (int(parent_vocab["d2t"].numel()) if files else min(32000, verifier_vocab))
    if size > verifier_vocab:
        raise DataError(f"draft_vocab_size={size} exceeds the verifier's vocabulary ({verifier_vocab})")
    new_d2t, new_t2d = build_vocab(data.token_freqs(), size)
    counts = {"draft_size": size, "kept": 0, "added": size, "dropped": 0}
    vocab = {"d2t": new_d2t, "t2d": new_t2d}
    if files:
        plan = plan_remap(parent_vocab["d2t"], new_d2t)
        counts.update(kept=plan.kept, added=plan.added, dropped=plan.dropped)
        vocab["new_rows_from_old"] = plan.new_rows_from_old
    return vocab, counts


def record_plan(cfg: FinetuneConfig, ranks: int, on_cpu: bool, verifier: str, draft_vocab_size: int,
                aux_layer_ids: list[int], run_id: str, layer: dict | None = None, nodes: int = 1) -> None:
    """Plan the run about to launch (``draftline plan``'s estimate), print one line to stderr, log ``plan.json``
    and the param ``plan.fits`` (true | false | unchecked, without a GPU | error). Never stops the launch."""
    try:
        gpus, nodes = hostfile_shape(cfg.hostfile) if cfg.hostfile else (ranks, nodes)
        config = verifier_config(verifier, draft_vocab_size=draft_vocab_size, aux_layer_ids=aux_layer_ids,
                                 layer=layer)
        plan = planning.make_plan(config, gpus=gpus, nodes=nodes,
                                  gpu_memory_gib=None if on_cpu else gpu_memory_gib(),
                                  tokens_per_batch=cfg.tokens_per_batch, ttt_steps=cfg.ttt_steps,
                                  precision="bf16" if cfg.precision == "auto" else cfg.precision,
                                  attn_impl=cfg.attn_impl, zero_stage=cfg.zero_stage, steps=cfg.steps,
                                  name=f"verifier {verifier}, draft vocabulary {draft_vocab_size}")
    except Exception as e:  # noqa: BLE001 (an estimate must not stop a training run)
        say(f"plan: not computed ({type(e).__name__}: {e})")
        fits = "error"
    else:
        stage = plan["stages"][str(cfg.zero_stage)]
        fits = "unchecked" if plan["fits"] is None else str(plan["fits"]).lower()
        say(f"plan: ZeRO-{cfg.zero_stage} needs {planning.gib(stage['total'])} GiB per GPU "
              f"({plan['trainable']:,} trainable parameters); fits: {fits}. Full table: plan.json in the run, "
              "or `draftline plan`")
        err = planning.fit_error(plan, cfg.zero_stage)
        if err:
            say(f"plan: WARNING {err}")
        mlflow.log_dict(dict(plan), "plan.json")
    if names.PLAN_FITS not in mlflow.get_run(run_id).data.params:  # a resumed run keeps its first plan's verdict
        log_params_once({names.PLAN_FITS: fits}, run_id)


def check_resumable(run_id: str) -> None:
    """``--resume RUN_ID`` names a finetune run on this tracking server, trained in vLLM's pairing (a run
    started before draftline trained in that pairing cannot be continued in it)."""
    try:
        run = tracking.client().get_run(run_id)
    except Exception:  # noqa: BLE001
        raise DataError(f"--resume {run_id}: no such run on {tracking_uri()}; pass the run_id finetune "
                        "printed") from None
    if run.data.tags.get(names.STEP) != "finetune":
        raise DataError(f"--resume {run_id} is a {run.data.tags.get(names.STEP) or 'non-draftline'} run, "
                        "not a finetune run")
    existing = run.data.params
    if existing and names.TRAIN_PAIRING not in existing:
        raise DataError(f"run {run_id} was trained before draftline paired hidden states with tokens as vLLM "
                        f"serves them ({PAIRING}); its checkpoint cannot be resumed: start a new finetune")


def resumed_precision(run_id: str) -> precision.Choice:
    """The precision a run's checkpoints were written in, and why (its ``train.precision*`` params)."""
    params = tracking.client().get_run(run_id).data.params
    return precision.Choice(params.get(names.TRAIN_PRECISION, "auto"),
                            params.get(names.TRAIN_PRECISION_CHOICE, "the resumed run's own precision"))


def run(cfg: FinetuneConfig, *, resume_run: str | None = None) -> FinetuneResult | NodeResult:
    """The finetune stage as one MLflow run; ``resume_run`` continues a run from its last checkpoint."""
    check_visible(cfg)
    place = job_place(cfg)
    ranks, on_cpu = resolve_ranks(cfg.gpus)
    if place.multi and not place.leader:
        return job.follow(cfg, place, resume_run=resume_run, ranks=ranks, on_cpu=on_cpu)
    leader = job.Leader(place, cfg.rendezvous_timeout) if place.multi else None
    try:
        return _lead(cfg, resume_run, place=place, ranks=ranks, on_cpu=on_cpu, leader=leader)
    finally:
        if leader:
            leader.close()


def _lead(cfg: FinetuneConfig, resume_run: str | None, *, place: Place, ranks: int, on_cpu: bool,
          leader: job.Leader | None) -> FinetuneResult:
    """Node 0 (or the only node): gather the job, resolve, open the run, launch, log."""
    telling = leader.telling() if leader else contextlib.nullcontext()
    with telling:
        if leader:
            leader.gather(job.settings_of(cfg, place, resume_run, ranks))  # before the run exists
        tracking.setup()
        inputs = _resolve_inputs(cfg, resume_run, ranks=ranks, on_cpu=on_cpu, nodes=place.nnodes)
    cfg, parent, manifest, layer = inputs.cfg, inputs.parent, inputs.data.manifest, inputs.layer

    with stop_on_signals(), tracking.stage_run("finetune", run_name=f"finetune from {parent.name}",
                                               run_id=resume_run, system_metrics=True) as active:
        run_id = active.info.run_id
        say(f"finetune run {run_id}: {tracking.run_link(active.info.experiment_id, run_id)}")
        if inputs.measured:
            say(f"precision: {inputs.chosen.precision} ({inputs.chosen.reason})")
        work = work_dir() / run_id
        work.mkdir(parents=True, exist_ok=True)
        sha = files_digest(inputs.files.weights) if inputs.files else "none"
        vocab_file = work / "vocab.safetensors"
        save_file({k: v.contiguous() for k, v in inputs.vocab.items()}, str(vocab_file))

        params = _run_params(inputs, sha=sha, ranks=ranks)
        tracking.log_params_once(params, run_id)
        _record_lineage(inputs, params, sha=sha, ranks=ranks, run_id=run_id,
                        experiment_id=active.info.experiment_id, resumed=bool(resume_run))

        ckpt_dir = work / "checkpoints"
        ckpt_dir.mkdir(exist_ok=True)
        spec = _worker_spec(inputs, run_id=run_id, work=work, ckpt_dir=ckpt_dir, vocab_file=vocab_file)
        (ckpt_dir / LAYER_FILE).write_text(json.dumps(layer, indent=2, sort_keys=True) + "\n")  # export reads it
        record_plan(cfg, ranks, on_cpu, manifest["verifier"], inputs.counts["draft_size"], manifest["aux_layer_ids"],
                    run_id, layer, nodes=place.nnodes)  # prints one line, logs plan.json and plan.fits
        if leader:
            with leader.telling():
                leader.go(spec, data_digest=manifest["digest"],
                          eval_digest=inputs.eval_data.manifest["digest"] if inputs.eval_data else None)
        launch(spec, work / "worker_spec.json", ranks=ranks, on_cpu=on_cpu, hostfile=cfg.hostfile,
               node=leader.node if leader else None)

        selected = _log_results(inputs, params, run_id=run_id, work=work, ckpt_dir=ckpt_dir)
    return FinetuneResult(run_id=run_id, weights_uri=f"runs:/{run_id}/{handoff.WEIGHTS}",
                          checkpoint=f"{selected['selected']} (step {selected['step']})")


@dataclass(frozen=True)
class _Inputs:
    """What finetune resolved and checked before its run exists (``cfg`` with its precision chosen)."""

    cfg: FinetuneConfig
    data: PreparedData
    data_run_id: str | None
    eval_data: PreparedData | None
    parent: Parent
    files: CheckpointFiles | None  # the parent's checkpoint (None: a random init)
    layout: str
    remap: str
    vocab: dict
    counts: dict[str, int]
    layer: dict
    chosen: precision.Choice
    measured: bool  # the precision was "auto"
    conf: dict  # the DeepSpeed config the ranks run
    world_size: int  # ranks on every node of the job
    aux_convention: str  # whose layers the parent's aux-layer ids name (vllm | sglang | none)


def _parent_reads(cfg: FinetuneConfig, parent: Parent, files: CheckpointFiles | None,
                  manifest: dict) -> tuple[str, list[int] | None]:
    """``(convention, ids)``: whose layers the parent's aux-layer ids name, and the ids vLLM captures for them
    (what the data must hold, and what the export writes); ``("none", None)`` without a parent or ids."""
    layers = int(hf_model.load_text_config(manifest["verifier"]).num_hidden_layers)
    convention, reads = ("none", None) if files is None else \
        aux_reads(parent, files.config or {}, cfg.parent_aux_convention, layers)
    if reads is None and cfg.parent_aux_convention != "auto":
        say(f"--parent-aux-convention {cfg.parent_aux_convention} is not used: "
            + ("a random init has no aux-layer ids" if files is None else f"parent {parent.name} names none"))
    return convention, reads


def _resolve_inputs(cfg: FinetuneConfig, resume_run: str | None, *, ranks: int, on_cpu: bool,
                    nodes: int = 1) -> _Inputs:
    """Data, parent, vocabulary, layer, precision and DeepSpeed config, found and checked before the run exists:
    a typo (init, data, stage, path) or any other mistake leaves no failed run behind."""
    if resume_run:
        check_resumable(resume_run)
    data_run_id = tracking.parse_run_ref(cfg.data)[0] if cfg.data.startswith("runs:/") else None
    data = open_prepared(resolve_data(cfg.data), verify=cfg.verify_data)
    manifest = data.manifest
    hf_model.trust_as_recorded(manifest["verifier"], manifest.get("verifier_trust_remote_code"))
    eval_data: PreparedData | None = None
    if cfg.eval_data:
        eval_data = open_prepared(resolve_data(cfg.eval_data), verify=True)
        preflight.check_same_verifier(manifest, eval_data.manifest, cfg.eval_data)
    parent = resolve_init(cfg.init, cache=work_dir() / "cache")
    # every check that needs no rank lives in train/preflight.py and runs here, before the run exists
    preflight.check_inputs(cfg, data)
    if cfg.epochs:
        per_node, node_count = hostfile_shape(cfg.hostfile) if cfg.hostfile else (ranks, nodes)
        world = per_node * node_count
        cfg = cfg.model_copy(update={"steps": steps_for_epochs(cfg, manifest, world, eval_data is not None)})
    files, layout, remap, header = None, "none", "none", None
    if parent.path is not None:  # not a random init
        files = find_checkpoint(parent.path, allow_pickle=cfg.allow_pickle)
        header = read_header(files)
        layout = detect_layout(header)
        preflight.check_parent_files(parent.name, files, header, manifest)
        remap = key_remap(layout)
    vocab, counts = choose_vocab(cfg, files, data, manifest["vocab_size"])
    layer = layer_config(manifest["verifier"], files.config if files else None, cfg.drafter_layer)
    layer = with_form(layer, form.choose(fc_norm=cfg.fc_norm, norm_output=cfg.norm_output,
                                         parent=None if files is None else parent.name,
                                         parent_config=files.config if files else None,
                                         parent_keys=header or (), aux_layers=len(manifest["aux_layer_ids"])))
    convention, reads = _parent_reads(cfg, parent, files, manifest)
    # every check a rank would make (keys, shapes, vocabulary, aux layers), before hashing and launch
    preflight.preflight(verifier=manifest["verifier"], layer=layer, manifest=manifest, vocab=vocab,
                        parent_files=files, header=header, vocab_policy=cfg.vocab, parent_name=parent.name,
                        parent_aux_layers=reads)
    chosen = precision.choose(cfg.precision, on_cpu=on_cpu, hidden=int(layer["hidden_size"]),
                              intermediate=int(layer["intermediate_size"]),
                              resumed=resumed_precision(resume_run) if resume_run else None)
    measured = cfg.precision == "auto"
    cfg = cfg.model_copy(update={"precision": chosen.precision,
                                 "attn_impl": attention.choose(cfg.attn_impl, on_cpu=on_cpu)})
    conf = ds_config(cfg)
    gpus, nodes = hostfile_shape(cfg.hostfile) if cfg.hostfile else (ranks, nodes)
    # DeepSpeed's own rules, before the run
    preflight.check_ds_config(conf, ds_config_path(cfg), world_size=gpus * nodes)
    return _Inputs(cfg=cfg, data=data, data_run_id=data_run_id, eval_data=eval_data, parent=parent, files=files,
                   layout=layout, remap=remap, vocab=vocab, counts=counts, layer=layer, chosen=chosen,
                   measured=measured, conf=conf, world_size=gpus * nodes, aux_convention=convention)


def steps_for_epochs(cfg: FinetuneConfig, manifest: dict, world_size: int, held_out: bool) -> int:
    """The optimiser steps of ``cfg.epochs`` passes over the data's training tokens (less the validation share
    when no evaluation set is given), ``world_size`` ranks packing ``tokens_per_batch`` each."""
    tokens = manifest["tokens"] * (1.0 if held_out else 1.0 - cfg.val_fraction)
    per_step = world_size * cfg.tokens_per_batch
    steps = max(1, math.ceil((cfg.epochs or 1.0) * tokens / per_step))
    say(f"--epochs {cfg.epochs:g}: {steps:,} steps ({tokens:,.0f} training tokens a pass, {world_size} rank(s) x "
        f"{cfg.tokens_per_batch:,} tokens a step)")
    return steps


def _run_params(inputs: _Inputs, *, sha: str, ranks: int) -> dict:
    """The run's params: the parent's lineage, the vocabulary, the verifier, the data and the training settings."""
    cfg, parent, counts, eval_data = inputs.cfg, inputs.parent, inputs.counts, inputs.eval_data
    eagle = split_form(inputs.layer)[1]
    manifest = inputs.data.manifest
    return {
        **lineage.parent_params(parent, sha256=sha, layout=inputs.layout, key_remap=inputs.remap),
        names.PARENT_AUX_CONVENTION: inputs.aux_convention,
        names.VOCAB_POLICY: cfg.vocab if not parent.is_random else "rebuild",
        names.VOCAB_DRAFT_SIZE: counts["draft_size"],
        names.VOCAB_KEPT: counts["kept"], names.VOCAB_ADDED: counts["added"], names.VOCAB_DROPPED: counts["dropped"],
        **lineage.verifier_params(manifest),
        names.DATA_DIGEST: manifest["digest"],
        names.DATA_URI: cfg.data,
        names.ZERO_STAGE: cfg.zero_stage,
        "world_size": inputs.world_size,
        "ttt_steps": cfg.ttt_steps,
        **optimizer_params(inputs.conf),
        names.TRAIN_STEPS: cfg.steps, names.TRAIN_EPOCHS: cfg.epochs if cfg.epochs else "none",
        names.TRAIN_TOKENS_PER_BATCH: cfg.tokens_per_batch,
        names.TRAIN_MICRO_BATCH_TOKENS: micro_batch_tokens(cfg),
        names.TRAIN_PRECISION: cfg.precision, names.TRAIN_PRECISION_CHOICE: inputs.chosen.reason,
        names.TRAIN_LR_SCHEDULE: cfg.lr_schedule,
        names.TRAIN_TTT_LOSS_DECAY: cfg.ttt_loss_decay, names.TRAIN_HIDDEN_NOISE: cfg.hidden_noise,
        names.TRAIN_SEED: cfg.seed, names.TRAIN_ATTN_IMPL: cfg.attn_impl, names.DRAFTER_LAYER: layer_kind(inputs.layer),
        **{f"drafter.{k}": v for k, v in eagle.fields().items()}, names.DRAFTER_EAGLE: eagle.name,
        names.TRAIN_VAL_FRACTION: cfg.val_fraction if eval_data is None else 0.0,
        names.TRAIN_PAIRING: PAIRING,
        names.EVAL_DATA_DIGEST: eval_data.manifest["digest"] if eval_data is not None else "none",
    }


def _record_lineage(inputs: _Inputs, params: dict, *, sha: str, ranks: int, run_id: str, experiment_id: str,
                    resumed: bool) -> None:
    """The run's lineage tags and note; a new run also records the data set and the parent model as inputs."""
    cfg, parent, manifest = inputs.cfg, inputs.parent, inputs.data.manifest
    origin = "random init" if parent.is_random else (
        f"{parent.name} v{parent.revision}" if parent.model_version else parent.name)
    mlflow.set_tags({**lineage.parent_tags(parent, inputs.data_run_id), **lineage.environment_tags(),
                     "mlflow.runName": f"finetune from {origin}",
                     "mlflow.note.content": (
                         f"EAGLE-3 drafter for {params[names.VERIFIER_NAME_OR_PATH]}, from {origin}"
                         + ("" if parent.is_random else f" (sha256 {sha[:12]}, {inputs.layout} layout)")
                         + f", on data {manifest['digest'][:12]} (vocabulary {params[names.VOCAB_POLICY]}); "
                         f"ZeRO-{cfg.zero_stage} on {inputs.world_size} rank(s), {cfg.steps} steps, pairing "
                         f"{PAIRING}.")})
    if not resumed:  # the data set and the parent model as the run's inputs (the UI links them)
        client = tracking.client()
        lineage.record_inputs(run_id, manifest=manifest, data_name=dataset_name(client, cfg.data),
                              parent_model=lineage.parent_model_id(client, parent, sha256=sha, layout=inputs.layout,
                                                                   experiment_id=experiment_id))


def _worker_spec(inputs: _Inputs, *, run_id: str, work: Path, ckpt_dir: Path, vocab_file: Path) -> WorkerSpec:
    """Everything a rank needs, in one spec (files in ``work``, checkpoints in ``ckpt_dir``)."""
    cfg, manifest, eval_data = inputs.cfg, inputs.data.manifest, inputs.eval_data
    return WorkerSpec(
        config=cfg, run_id=run_id, data_dir=str(inputs.data.root), verifier=manifest["verifier"],
        aux_layer_ids=manifest["aux_layer_ids"], layer=inputs.layer, vocab_file=str(vocab_file),
        parent_path=str(inputs.parent.path) if inputs.parent.path else None,
        micro_batch_tokens=micro_batch_tokens(cfg), ds_config=inputs.conf, checkpoint_dir=str(ckpt_dir),
        eval_data_dir=str(eval_data.root) if eval_data is not None else None,
        load_report=str(work / "parent_load_report.json"), error_file=str(work / "rank_error.json"),
        stop_file=str(work / "stop"), metrics_file=str(work / "metrics.jsonl"))


def _log_results(inputs: _Inputs, params: dict, *, run_id: str, work: Path, ckpt_dir: Path) -> dict:
    """After the ranks: metadata, config and load report, the handed-on weights (and the checkpoints when
    asked), the accuracy chart. Returns the selected checkpoint."""
    cfg = inputs.cfg
    meta = lineage.training_metadata(params, inputs.counts, extra={"finetune_run_id": run_id,
                                                                    "data_run_id": inputs.data_run_id})
    lineage.write_json(ckpt_dir / lineage.METADATA_FILE, meta)
    (work / "training_config.json").write_text(cfg.model_dump_json(indent=2))
    mlflow.log_artifact(str(ckpt_dir / lineage.METADATA_FILE))
    mlflow.log_artifact(str(work / "training_config.json"))
    if (work / "parent_load_report.json").is_file():
        mlflow.log_artifact(str(work / "parent_load_report.json"))
    selected = hand_off(ckpt_dir, work / handoff.WEIGHTS, inputs.layer, meta)
    mlflow.log_artifacts(str(work / handoff.WEIGHTS), artifact_path=handoff.WEIGHTS)
    mlflow.set_tags(handoff.run_tags(selected))
    if cfg.log_checkpoints:
        mlflow.log_artifacts(str(ckpt_dir), artifact_path="checkpoints")
    log_accuracy_chart(run_id, cfg.ttt_steps)
    return selected


def hand_off(ckpt_dir: Path, out: Path, layer: dict, meta: dict) -> dict:
    """Consolidate the selected checkpoint (the best by validation, else the newest) into bf16 weights."""
    selected = handoff.selection(ckpt_dir)
    shutil.rmtree(out, ignore_errors=True)
    handoff.write_weights(handoff.consolidate(ckpt_dir, selected["tag"]), out, layer=layer, selected=selected)
    lineage.write_json(out / lineage.METADATA_FILE, meta)
    best = selected.get("best")
    say(f"handing on the {selected['selected']} checkpoint (step {selected['step']}"
          + (f", {best['metric']} {best['value']:.3f}" if best else "") + f"); newest step {selected['last_step']}")
    return selected
