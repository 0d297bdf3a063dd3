"""``draftline plan``: what finetuning a drafter takes, before anything is launched (the work is in
:mod:`draftline.train.plan`, imported when the command runs)."""

from __future__ import annotations

import json

import click

from draftline import names
from draftline.cli.common import _stdout_to_stderr, cli, shared_settings
from draftline.config import FinetuneConfig
from draftline.data.storage import DEFAULT_SAMPLES, DEFAULT_TOKENS_PER_SAMPLE
from draftline.train import phases
from draftline.train.interconnect import DEFAULT_GPU, DEFAULT_GPU_MEMORY_GIB, DEFAULT_TFLOPS, LINKS
from draftline.train.plan_types import Plan

# finetune's own settings, as it declares them: the plan is of the run `finetune` with the same flags would launch
SHARED = ("drafter_layer", "draft_vocab_size", "tokens_per_batch", "ttt_steps", "precision", "attn_impl", "steps",
          "epochs")


@cli.command()
@shared_settings(FinetuneConfig, *SHARED)
@click.option("--drafter", default=None, type=click.Path(exists=True),
              help="Drafter directory or its config.json (speculators, SpecForge or vLLM's MLA layout) "
                   "[default: the real Kimi drafter of --drafter-layer].")
@click.option("--verifier", default=None, type=click.Path(exists=True),
              help="The verifier's directory or config.json (Kimi-K2.5's kimi_k25 wrapper included; read as JSON, no "
                   "custom code run): the shards are sized from its hidden size, checked against the drafter's.")
@click.option("--gpus", type=click.IntRange(1), default=8, show_default=True,
              help="GPUs per node of the machines planned for (finetune's --gpus counts the ranks it launches on "
                   "the node it runs on, 0 for all of them: a plan is made where those GPUs are not).")
@click.option("--nodes", type=click.IntRange(1), default=1, show_default=True,
              help="Nodes (finetune's --nnodes).")
@click.option("--gpu-memory-gib", type=click.FloatRange(0, min_open=True), default=DEFAULT_GPU_MEMORY_GIB,
              show_default=True, help=f"Memory per GPU (the default: {DEFAULT_GPU}; 180: B200; 141: H200).")
@click.option("--interconnect", "link", type=click.Choice(sorted(LINKS)), default="pcie", show_default=True,
              help="What joins the GPUs: pcie (the mission's RTX PRO 6000s, 63 GB/s per direction) or nvlink "
                   "(HGX B200, 900 GB/s); sets the bandwidth each stage's traffic is timed at.")
@click.option("--link-gb-s", type=click.FloatRange(0, min_open=True), default=None,
              help="The bandwidth to time traffic at instead, in GB/s per direction (nccl-tests' all_reduce_perf "
                   "bus bandwidth on your machine).")
@click.option("--gpu-tflops", type=click.FloatRange(0, min_open=True), default=DEFAULT_TFLOPS, show_default=True,
              help="bf16 dense TFLOP/s the compute is timed at (the default is derived from NVIDIA's RTX PRO 6000 "
                   "figure; pass what yours reaches).")
@click.option("--samples", type=click.IntRange(1), default=DEFAULT_SAMPLES, show_default=True,
              help="Samples prepare will capture, for the shards' bytes.")
@click.option("--tokens-per-sample", type=click.IntRange(1), default=DEFAULT_TOKENS_PER_SAMPLE, show_default=True,
              help="Tokens a sample, assumed (Kimi-K2.5 answers with its reasoning: 2,000-4,000); prepare "
                   "measures them from the conversations.")
@click.option("--margin", type=click.FloatRange(0, 1, max_open=True), default=0.10, show_default=True,
              help="Share of GPU memory kept free for what is not modelled (CUDA context, NCCL, fragmentation).")
@click.option("--zero-stage", type=click.IntRange(0, 3), default=None,
              help="The stage you will train with (finetune's --zero-stage): exit 1 when it does not fit "
                   "[default: every stage compared and the one to use picked].")
@click.option("--data", default=None,
              help="A prepared data set (runs:/<prepare run>/data or its folder): its measured tokens a sample and "
                   "generated tokens a reply replace --tokens-per-sample's assumption.")
@click.option("--regenerate-tokens-per-s", type=click.FloatRange(0, min_open=True),
              default=phases.Assumptions.regenerate_tokens_per_s, show_default=True,
              help="The serving endpoint's aggregate decode rate while it answers the prompts (vLLM's "
                   "generation_tokens_total over a busy minute).")
@click.option("--capture-tokens-per-s", type=click.FloatRange(0, min_open=True),
              default=phases.Assumptions.capture_tokens_per_s, show_default=True,
              help="The verifier's prefill rate with hidden-state extraction (prompt tokens/s).")
@click.option("--disk-gb-s", type=click.FloatRange(0, min_open=True), default=phases.Assumptions.disk_gb_s,
              show_default=True, help="The shards' file system's bandwidth (capture writes, training reads).")
@click.option("--verifier-gb", type=click.FloatRange(0, min_open=True), default=phases.Assumptions.verifier_gb,
              show_default=True, help="The verifier's checkpoint size, read at each vLLM start (Kimi-K2.5: 554).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON only.")
def plan(drafter, drafter_layer, verifier, draft_vocab_size, gpus, nodes, gpu_memory_gib, link, link_gb_s, gpu_tflops,
         samples, tokens_per_sample, tokens_per_batch, ttt_steps, precision, attn_impl, margin, zero_stage, data,
         steps, epochs, regenerate_tokens_per_s, capture_tokens_per_s, disk_gb_s, verifier_gb, as_json):
    """What finetuning a drafter takes, before anything is launched: GPU memory per ZeRO stage (exact parameter
    counts on the meta device, DeepSpeed's model-state estimators, an activation estimate) and whether each stage
    fits; what each stage sends over the interconnect per step beside the compute, and the stage to use; and
    the disk the prepared shards will take."""
    from draftline.serving import hf_model
    from draftline.train import plan as planning

    # finetune's "auto", as it resolves on GPUs: bf16, sdpa, and for a drafter not given the verifier's attention
    # (MLA for Kimi-K2.5, the mission's, when no --verifier says otherwise)
    precision = "bf16" if precision == "auto" else precision
    attn_impl = "sdpa" if attn_impl == "auto" else attn_impl
    if drafter_layer == "auto":
        drafter_layer = "mla" if verifier is None or hf_model.uses_mla(verifier) else "llama"
    reply_tokens = None
    if data:
        samples, tokens_per_sample, reply_tokens = measured_lengths(data, samples)
    assumed = phases.Assumptions(regenerate_tokens_per_s=regenerate_tokens_per_s,
                                 capture_tokens_per_s=capture_tokens_per_s, disk_gb_s=disk_gb_s,
                                 verifier_gb=verifier_gb)
    with _stdout_to_stderr():
        out = planning.make_plan(drafter, gpus=gpus, nodes=nodes, gpu_memory_gib=gpu_memory_gib,
                                 tokens_per_batch=tokens_per_batch, ttt_steps=ttt_steps, precision=precision,
                                 attn_impl=attn_impl, margin=margin, zero_stage=zero_stage, layer=drafter_layer,
                                 draft_vocab_size=draft_vocab_size, link=link, link_gb_s=link_gb_s,
                                 gpu_tflops=gpu_tflops, samples=samples, tokens_per_sample=tokens_per_sample,
                                 verifier=verifier, epochs=epochs, steps=steps, reply_tokens=reply_tokens, assumptions=assumed)
    click.echo(json.dumps(out, indent=2) if as_json else render_plan(out))
    if zero_stage is not None:
        planning.check(out, zero_stage)


def measured_lengths(data: str, samples: int) -> tuple[int, int, int]:
    """``(samples, tokens a sample, generated tokens a reply)`` measured on a prepared data set: its mean sample
    length and its replies' median (the whole sample where it was not regenerated); ``samples`` is kept (the run
    planned is larger than the data set measured)."""
    from draftline.data.refs import resolve_data
    from draftline.data.shards import open_prepared

    with _stdout_to_stderr():
        manifest = open_prepared(resolve_data(data), verify=False).manifest
    per_sample = max(1, round(manifest["tokens"] / max(manifest["samples"], 1)))
    regenerated = manifest.get("regenerated") or {}
    reply = int(regenerated.get(names.DATA_REPLY_TOKENS_P50) or manifest["masked_tokens"] / max(manifest["samples"], 1))
    return samples, per_sample, max(1, reply)


def render_plan(plan: Plan) -> str:
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
        cells = [planning.gib(n, unit) for n in (s["model_states"], s["frozen"], s["activations"], s["total"],
                                                  s["headroom"])]
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
    return "\n".join(lines + _traffic_lines(plan) + _storage_lines(plan["storage"], plan.get("verifier"))
                     + phases.lines(plan["run"]))


def _traffic_lines(plan: Plan) -> list[str]:
    t = plan["interconnect"]
    compute = "" if t["compute_s"] is None else (
        f"; compute {t['step_flops'] / 1e12:.1f} TFLOP a step = {t['compute_s'] * 1e3:.0f} ms at "
        f"{t['gpu_tflops']:g} TFLOP/s ({t['tflops_source']})")
    lines = ["", f"interconnect: {t['link']} at {t['bandwidth_gb_s']:g} GB/s per direction ({t['bandwidth_source']})"
             f"{compute}",
             f"  {'per GPU, a step':<16}{'sent GB':>9}{'link ms':>9}{'link/compute':>14}  formula (b bytes a value)"]
    for stage, s in t["stages"].items():
        ratio = "-" if s["link_over_compute"] is None else f"{s['link_over_compute']:.2f}"
        lines.append(f"  ZeRO-{stage:<11}{s['sent_bytes'] / 1e9:>9.2f}{s['link_s'] * 1e3:>9.0f}{ratio:>14}  "
                     f"{s['formula']}")
    lines.append("  lower bounds: the link's figure, the GPU's peak; DeepSpeed overlaps the reduce with the backward")
    chosen = plan["recommended_stage"]
    lines.append(f"use: {'none' if chosen is None else f'--zero-stage {chosen}'}: {plan['recommended_because']}")
    return lines


def _storage_lines(s: dict, verifier: str | None) -> list[str]:
    from draftline.disk_space import human_bytes

    of = f" of {verifier}" if verifier else ""
    return ["", f"prepared shards{of}: {human_bytes(s['bytes'])} for {s['samples']:,} samples x "
                f"{s['tokens'] // s['samples']:,} tokens ({s['tokens_source']}; --samples, --tokens-per-sample), "
                f"{s['bytes_per_token']:,} bytes a token in {s['storage']}; prepare asks for "
                f"{human_bytes(s['needed_bytes'])} free on its --output-dir and measures the tokens",
            "  " + "; ".join(f"--hidden-storage {k}: {human_bytes(v)}" for k, v in s["bytes_by_storage"].items())
            + " (fp8: E4M3, a scale per token and layer; what it costs in served acceptance: docs/results.md)"]



