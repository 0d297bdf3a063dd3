"""``draftline``: the command line. Each command parses flags and calls one library function.

Options of the stage commands are generated from the stage's pydantic settings (their descriptions are the
help), and ``--config FILE`` supplies any of them from YAML (flag > file > default). Expected failures print one
line and exit 1 (2 for usage errors); anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import typing
from pathlib import Path

import click

from draftline.errors import DraftlineError

os.environ.setdefault("LOGURU_LEVEL", "WARNING")  # speculators logs every file it opens at INFO
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class _Command(click.Command):
    """Accepts ``--snake_case`` spellings of its options (MLflow passes undeclared parameters that way)."""

    def parse_args(self, ctx, args):
        known = {o for p in self.params for o in p.opts}
        fixed = []
        for arg in args:
            name, eq, value = arg.partition("=")
            if name.startswith("--") and "_" in name and name not in known and name.replace("_", "-") in known:
                arg = name.replace("_", "-") + eq + value
            fixed.append(arg)
        return super().parse_args(ctx, fixed)


class _Group(click.Group):
    command_class = _Command

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except DraftlineError as e:
            click.secho(f"error: {e}", fg="red", err=True)
            ctx.exit(e.exit_code)


def _is_list(annotation) -> bool:
    return any(typing.get_origin(a) is list for a in (annotation, *typing.get_args(annotation)))


def _metavar(annotation) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return "[" + "|".join(str(a) for a in args) + "]"
    if _is_list(annotation):
        return "A,B,C"
    inner = [a for a in args if a is not type(None)] if args else [annotation]
    return {int: "INT", float: "FLOAT"}.get(inner[0], "TEXT") if len(inner) == 1 else "TEXT"


def settings_options(model):
    """Decorate a command with one option per settings field (``--kebab-name``), help from the description."""

    def decorate(f):
        for name, field in reversed(list(model.model_fields.items())):
            flag = "--" + name.replace("_", "-")
            default = None if field.is_required() else field.default
            help_ = (field.description or "") + (f"  [default: {default}]" if default not in (None, "") else "")
            if field.annotation is bool:
                # `--log-shards`, `--no-log-shards`, or a value (`--log-shards false`, as MLproject passes it)
                f = click.option(f"--no-{name.replace('_', '-')}", f"no_{name}", is_flag=True, default=False,
                                 hidden=True)(f)
                f = click.option(flag, name, type=str, is_flag=False, flag_value="true", default=None,
                                 help=help_, metavar="[true|false]")(f)
            else:
                # strings in, pydantic validates: an empty value (MLproject's "unset") means the default
                f = click.option(flag, name, type=str, default=None, help=help_,
                                 metavar=_metavar(field.annotation))(f)
        return click.option("--config", "config_file", type=click.Path(dir_okay=False), default=None,
                            help="YAML file of settings (flags override it).")(f)

    return decorate


@contextlib.contextmanager
def _stdout_to_stderr():
    """Send everything printed meanwhile to stderr, from Python and from child processes (fd 1 itself):
    MLflow, DeepSpeed and the runs `main` starts all print there."""
    try:
        out_fd, err_fd = sys.__stdout__.fileno(), sys.__stderr__.fileno()
        saved = os.dup(out_fd)
    except (AttributeError, OSError, ValueError):
        saved = None
    try:
        if saved is not None:
            sys.__stdout__.flush()
            os.dup2(err_fd, out_fd)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        if saved is not None:
            sys.__stdout__.flush()
            os.dup2(saved, out_fd)
            os.close(saved)


def _result(fn, *args, **kwargs):
    """Run a library call with its output on stderr; print its result as JSON on stdout, so
    `draftline ... | jq` always works."""
    with _stdout_to_stderr():
        out = fn(*args, **kwargs)
    click.echo(json.dumps(out, indent=2, default=str))
    return out


def _settings(model, config_file, flags):
    from draftline.config import resolve

    flags = {k: v for k, v in flags.items() if v != ""}
    for name in [k for k in flags if k.startswith("no_") and k[3:] in model.model_fields]:
        if flags.pop(name):
            flags[name[3:]] = False
    for name, field in model.model_fields.items():
        value = flags.get(name)
        if _is_list(field.annotation) and isinstance(value, str):
            try:
                flags[name] = [int(x) for x in value.replace(" ", "").split(",") if x]
            except ValueError:
                raise click.BadParameter(f"expected comma-separated integers such as 2,30,58, got {value!r}",
                                         param_hint="--" + name.replace("_", "-")) from None
    return resolve(model, flags=flags, file=config_file)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="draftline")
@click.option("-v", "--verbose", is_flag=True, help="Log at DEBUG level.")
def cli(verbose: bool):
    """draftline: EAGLE-3 drafters made from a verifier's own outputs, finetuned from a parent drafter with
    DeepSpeed ZeRO, and shipped with their lineage through the MLflow Model Registry to vLLM.

    \b
    Pipeline:  prepare -> finetune -> export (registers a version) -> promote -> pull
    Tracking:  MLFLOW_TRACKING_URI (default: sqlite:///$PWD/mlflow.db); experiment: DRAFTLINE_EXPERIMENT
    """
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(levelname)s %(message)s")
    for chatty in ("httpx", "httpcore", "urllib3"):  # one line per HTTP request otherwise
        logging.getLogger(chatty).setLevel(logging.DEBUG if verbose else logging.WARNING)


@cli.command("make-tiny")
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--conversations", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Text to train the tokenizer and the parent on [default: the demo conversations].")
@click.option("--parent-steps", type=click.IntRange(0, 100000), default=150, show_default=True,
              help="Optimiser steps for the tiny parent.")
@click.option("--seed", type=int, default=0, show_default=True)
def make_tiny_cmd(out_dir, conversations, parent_steps, seed):
    """Write a tiny verifier (OUT_DIR/verifier) and a tiny AQ-MedAI-layout parent (OUT_DIR/parent).

    The catalog entry `init=tiny` finds the parent through DRAFTLINE_TINY_DIR=OUT_DIR (or work/tiny)."""
    from draftline.config import shipped
    from draftline.testing.tiny import make_tiny

    src = Path(conversations) if conversations else shipped("configs", "demo", "conversations.jsonl")
    _result(make_tiny, Path(out_dir), src, parent_steps=parent_steps, seed=seed)


from draftline.config import ExportConfig, FinetuneConfig, PrepareConfig  # noqa: E402  (pydantic only: cheap)


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
@settings_options(ExportConfig)
def export(config_file, **flags):
    """Consolidate, validate and register a finetune run's drafter as a new model version."""
    from draftline.export import run

    _result(run, _settings(ExportConfig, config_file, flags))


@cli.command("main")
@click.option("--conversations", required=True, help="Conversations file for prepare.")
@click.option("--verifier", required=True, help="Verifier directory or cached repo id.")
@click.option("--init", default=FinetuneConfig.model_fields["init"].default, show_default=True,
              help="Parent drafter (see finetune --help).")
@click.option("--registered-model", default=ExportConfig.model_fields["registered_model"].default, show_default=True,
              help="Registered model the version is added to.")
@click.option("--set", "overrides", multiple=True, metavar="STEP.KEY=VALUE",
              help="Extra entry-point parameter, e.g. finetune.steps=20 (repeatable).")
@click.option("--no-cache", is_flag=True, help="Rerun every step even if a matching finished run exists.")
def main_cmd(conversations, verifier, init, registered_model, overrides, no_cache):
    """prepare -> finetune -> export as child runs of one MLflow run, reusing finished steps that match."""
    from draftline.pipeline import run_main

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
            import difflib

            near = difflib.get_close_matches(name, fields, n=1)
            raise click.BadParameter(f"{step} has no setting {name!r}" + (f"; did you mean {step}.{near[0]}?" if near
                                     else f"; see draftline {step} --help"), param_hint="--set")
        extra.setdefault(step, {})[name] = value
    _result(run_main, conversations=conversations, verifier=verifier, init=init,
            registered_model=registered_model, extra=extra, use_cache=not no_cache)


@cli.command()
@click.argument("name")
@click.argument("version")
@click.option("--to", "stage", type=click.Choice(["Staging", "Production"], case_sensitive=False), required=True)
@click.option("--policy", "policy_file", type=click.Path(dir_okay=False), default=None,
              help="Policy YAML [default: registry_policies/<stage>.yaml].")
@click.option("--dry-run", is_flag=True, help="Evaluate the policy and change nothing.")
def promote(name, version, stage, policy_file, dry_run):
    """Promote VERSION of registered model NAME to a stage through its policy (registry_policies/), archiving
    the previous holder and pointing the alias (@staging/@production) at it."""
    from mlflow import MlflowClient

    from draftline import registry, tracking

    with _stdout_to_stderr():
        tracking.setup()
        results, mv = registry.promote(MlflowClient(), name, version, stage, policy_file=policy_file,
                                       dry_run=dry_run)
    click.echo(registry.format_results(results))
    if dry_run:
        click.echo(f"dry run: models:/{name}/{mv.version} would move to {stage.capitalize()}; nothing changed")
    else:
        click.echo(f"models:/{name}/{mv.version} is now {mv.current_stage} (alias @{stage.lower()})")


@cli.command()
@click.argument("name")
@click.option("--stage", default=None, help="Pull the version in this stage (e.g. Production).")
@click.option("--alias", default=None, help="Pull the version this alias points at (e.g. production).")
@click.option("--version", "version", default=None, help="Pull this version number.")
@click.option("--dest", type=click.Path(file_okay=False), required=True, help="Directory to download into.")
@click.option("--verifier", default=None, help="Refuse the version unless it was trained for this verifier.")
@click.option("--no-cache", is_flag=True, help="Download every file even if the local cache holds it "
              "($DRAFTLINE_CACHE_DIR, default ~/.cache/draftline).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON only.")
def pull(name, stage, alias, version, dest, verifier, no_cache, as_json):
    """Download a registered drafter, verify every file against its checksums, print the vLLM command.

    Files are hashed while they arrive; files already in the local content-addressed cache (same sha256)
    are hard-linked instead of downloaded, so a restarted pod or a version sharing files costs nothing.
    DEST receives the complete verified directory or is left as it was."""
    from mlflow import MlflowClient

    from draftline import registry, tracking

    with _stdout_to_stderr():
        tracking.setup()
        out = registry.pull(MlflowClient(), name, stage=stage, alias=alias, version=version, dest=Path(dest),
                            verifier=verifier, use_cache=not no_cache)
    if as_json:
        click.echo(json.dumps(out, indent=2))
    else:
        mib = 1 << 20
        click.echo(f"pulled models:/{name}/{out['version']} into {out['path']} (checksums verified; "
                   f"{out['downloaded_bytes'] / mib:.1f} MiB downloaded, {out['cached_bytes'] / mib:.1f} MiB "
                   f"from the cache)\n{out['command']}")


@cli.command()
@click.argument("name")
@click.argument("version")
@click.option("--json", "as_json", is_flag=True, help="Print JSON only.")
def lineage(name, version, as_json):
    """The ancestry of VERSION of NAME (a number, a stage, @alias, or a models:/ URI) back to its external
    root, with the data digest and headline metrics of every generation."""
    from mlflow import MlflowClient

    from draftline import tracking
    from draftline.lineage_walk import render, walk

    uri = version if version.startswith("models:/") else \
        f"models:/{name}@{version[1:]}" if version.startswith("@") else f"models:/{name}/{version}"
    with _stdout_to_stderr():
        tracking.setup()
        chain = walk(MlflowClient(), uri)
    click.echo(json.dumps(chain, indent=2) if as_json else render(chain))


@cli.command()
@click.argument("target")
@click.option("--allow-pickle", is_flag=True, help="Read a pickle-only checkpoint (weights_only=True).")
def inspect(target, allow_pickle):
    """Describe a drafter checkpoint (directory, runs:/ or models:/ URI) without loading it."""
    from draftline.inspect import describe

    _result(describe, target, allow_pickle=allow_pickle)


@cli.command()
@click.option("--drafter", default=None, type=click.Path(exists=True),
              help="Drafter directory or its config.json (speculators or SpecForge layout) "
                   "[default: the real Kimi-K2 EAGLE-3 drafter's shape].")
@click.option("--gpus", type=click.IntRange(1), default=8, show_default=True, help="GPUs per node.")
@click.option("--nodes", type=click.IntRange(1), default=1, show_default=True)
@click.option("--gpu-memory-gib", type=click.FloatRange(0, min_open=True), default=180.0, show_default=True,
              help="Memory per GPU (180: B200).")
@click.option("--tokens-per-batch", type=click.IntRange(1), default=4096, show_default=True,
              help="Packed tokens per rank per step.")
@click.option("--ttt-steps", type=click.IntRange(1, 16), default=3, show_default=True)
@click.option("--precision", type=click.Choice(["bf16", "fp32"]), default="bf16", show_default=True)
@click.option("--attn-impl", type=click.Choice(["sdpa", "eager", "simple_flex_attention"]), default="sdpa",
              show_default=True)
@click.option("--margin", type=click.FloatRange(0, 1, max_open=True), default=0.10, show_default=True,
              help="Share of GPU memory kept free for what is not modelled (CUDA context, NCCL, fragmentation).")
@click.option("--zero-stage", type=click.IntRange(0, 3), default=None,
              help="The stage you will train with: exit 1 when it does not fit.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON only.")
def plan(drafter, gpus, nodes, gpu_memory_gib, tokens_per_batch, ttt_steps, precision, attn_impl, margin,
         zero_stage, as_json):
    """GPU memory per ZeRO stage for finetuning a drafter: exact parameter counts (meta device), DeepSpeed's
    model-state estimators, an activation estimate, and whether each stage fits."""
    from draftline import plan as planning

    with _stdout_to_stderr():
        out = planning.make_plan(drafter, gpus=gpus, nodes=nodes, gpu_memory_gib=gpu_memory_gib,
                                 tokens_per_batch=tokens_per_batch, ttt_steps=ttt_steps, precision=precision,
                                 attn_impl=attn_impl, margin=margin, zero_stage=zero_stage)
    click.echo(json.dumps(out, indent=2) if as_json else render_plan(out))
    if zero_stage is not None:
        planning.check(out, zero_stage)


def render_plan(plan: dict) -> str:
    """The plan as a plain-text table."""
    from draftline import plan as planning

    lg, lf, a = plan["largest_layer"], plan["largest_frozen_layer"], plan["activations"]
    big = max(s["total"] for s in plan["stages"].values()) >= planning.GIB
    unit, unit_name = (planning.GIB, "GiB") if big else (1 << 20, "MiB")  # tiny drafters in MiB
    mem = "GPU memory unknown: fit not checked" if plan["gpu_memory_gib"] is None else (
        f"{plan['gpu_memory_gib']:g} GiB per GPU less {plan['margin']:.0%} margin = {planning.gib(plan['budget_bytes'])} GiB")
    lines = [
        f"drafter: {plan['drafter']}",
        f"  params {plan['params']:,} = trainable {plan['trainable']:,} + frozen {plan['frozen']:,} "
        f"({', '.join(plan['frozen_names'])})",
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



def main() -> None:
    cli(prog_name="draftline")


if __name__ == "__main__":
    sys.exit(main())
