"""The evaluate stage: one drafter (a parent, a registered version or a finetune run) on one fixed evaluation
set, measured two ways, logged as one MLflow run and onto the drafter's LoggedModel with the data set.

* teacher-forced: speculators' forward over the prepared samples (``eval/teacher_forced/*``);
* measured: real greedy chain speculative decoding against the verifier on the set's prompts
  (``eval/measured/*``: acceptance length as vLLM defines it, per-position acceptance rates, and whether the
  output was token for token the verifier's own greedy output), in this process or on a vLLM server.

From the measured per-position rates it recommends ``num_speculative_tokens`` (export writes it into the
version's ``speculators_config``).
"""

from __future__ import annotations

import json
import logging
import sys
import tempfile
from pathlib import Path

import mlflow
import torch
from transformers import GenerationConfig

from draftline import names, tracking
from draftline.config import EvaluateConfig, work_dir
from draftline.console import say
from draftline.data.refs import dataset_name, resolve_data
from draftline.data.regenerate import served_models
from draftline.data.shards import open_prepared
from draftline.drafter.served import is_mla_drafter
from draftline.errors import DataError, UsageError
from draftline.evaluation.chain import measure_chain, recommend_num_speculative_tokens
from draftline.evaluation.loopback import measure_loopback
from draftline.evaluation.speed import (
    fastest_k,
    lowest,
    measure_speed,
    speed_metrics,
    speed_summary,
    sweep_metrics,
    sweep_text,
)
from draftline.evaluation.targets import load_drafter, resolve_target
from draftline.evaluation.teacher_forced import greedy_replies, measure, prompts_of, served_samples
from draftline.evaluation.vllm_backend import measure_vllm
from draftline.registry import lineage
from draftline.registry.confidence import PER_PROMPT_FILE, acceptance_interval, acceptance_of, carry_per_prompt
from draftline.results import EvaluateResult, Measured
from draftline.serving import hf_model
from draftline.serving.client import TOP_LOGPROBS
from draftline.serving.engine import cannot_draft_beside, vllm_python
from draftline.serving.vllm_support import require_served, unserved
from draftline.util import interrupt_on_signals, same_command

log = logging.getLogger(__name__)
TARGET_RUN_TAG = "draftline.evaluate.target_run"  # the finetune run evaluated (export finds its evaluations)
TARGET_STEP_TAG = "draftline.evaluate.step"
RESULT_FILE = "evaluation.json"


def _verifier(cfg: EvaluateConfig, manifest: dict) -> str:
    path = cfg.verifier or manifest["verifier"]
    if not Path(path).expanduser().is_dir():
        raise DataError(f"the verifier {path} the evaluation set was captured from is not on this machine: pass "
                        "--verifier DIR (the same model, here)")
    return str(Path(path).expanduser())


PREDICTION_TOLERANCE = 0.1  # measured 0.001-0.014 apart on the real tier (bf16 shards, float32 vLLM)


def _predicted(cfg: EvaluateConfig, drafter, records, manifest: dict, measured: float, progress: bool, *,
               outputs: list[list[int]] | None = None, per_prompt: list[dict] | None = None) -> dict:
    """vLLM's walk over the drafter's own teacher-forced drafts on the very replies the measurement asked for:
    what serving should report. Far from the measured figure on the verifier's greedy replies, serving is not
    running the model that was trained; that is said, and logged.

    With ``outputs`` (the measurement's generated ids, in prompt order) only the replies the data holds token for
    token as they were served are walked, and compared with the measurement on those prompts (``per_prompt``;
    without it, only when every prompt is walked): a reply prepare could not keep as the server's ids (a
    re-tokenised lossy text, an empty turn) predicts nothing about its prompt."""
    kept = served_samples(records, cfg.max_prompts, cfg.max_new_tokens, outputs)
    if not kept:
        return {}
    predicted = measure(drafter, [s for _, s in kept], ttt_steps=cfg.num_speculative_tokens,
                        tokens_per_batch=cfg.tokens_per_batch, progress=progress).get("walk_acceptance_length")
    if predicted is None:  # no draft is made on these replies (all shorter than two tokens)
        return {}
    out = {names.PREDICTED: predicted, names.PREDICTED_PROMPTS: float(len(kept))}
    if outputs is not None and len(kept) < len(outputs):
        on_kept = _measured_on(per_prompt or [], [j for j, _ in kept])
        if on_kept is None:
            return out
        measured = on_kept
    if greedy_replies(manifest) and abs(measured - predicted) > PREDICTION_TOLERANCE:
        say(f"warning: served acceptance {measured:.3f}, but the drafter's own forward over the same greedy "
            f"replies predicts {predicted:.3f}: what is served is not the model that was trained (compare the "
            "export's config.json with the checkpoint: norm_before_residual, target layers, d2t; docs/design.md)")
    return {**out, names.PREDICTED_DIFFERENCE: measured - predicted}


def _measured_on(per_prompt: list[dict], prompts: list[int]) -> float | None:
    """vLLM's acceptance length over ``prompts`` alone, from the per-prompt evidence (None without it)."""
    if not per_prompt or max(prompts) >= len(per_prompt):
        return None
    return acceptance_of([per_prompt[j] for j in prompts])


def backend_of(cfg: EvaluateConfig, verifier_dir: str, *, mla_drafter: bool = False) -> str:
    """Where the measured figure comes from: ``vllm-endpoint`` (a server the user runs), ``vllm`` (a loopback
    vLLM this command starts), ``transformers`` (in this process) or ``none``. Checked before the run exists;
    ``mla_drafter``: the drafter has an MLA layer (vLLM serves it beside an MLA verifier on every host)."""
    backend = _backend(cfg, verifier_dir, mla_drafter)
    if cfg.sweep and backend != "vllm":
        raise UsageError(f"--sweep-k starts a drafted vLLM server per k, and evaluate measures on {backend} here: "
                         "install vLLM (./setup.sh --vllm) and drop --backend transformers, or drop --sweep-k")
    return backend


def _backend(cfg: EvaluateConfig, verifier_dir: str, mla_drafter: bool) -> str:
    if not cfg.measured:
        return "none"
    if cfg.vllm_endpoint:
        return "vllm-endpoint"
    if cfg.backend == "transformers":
        return "transformers"
    reason = cannot_draft_beside(verifier_dir, mla_drafter=mla_drafter)
    if reason and cfg.backend == "vllm":
        raise UsageError(f"--backend vllm cannot measure here: {reason}; pass --backend transformers (or auto)")
    python = vllm_python(required=cfg.backend == "vllm")
    if cfg.backend == "vllm":
        require_served(verifier_dir, python, fix="pass --backend transformers (or auto)")
    reason = reason or unserved(verifier_dir, python)
    if reason:
        say(f"measuring in this process: {reason}")
        return "transformers"
    return "vllm" if python else "transformers"


def _in_process(cfg: EvaluateConfig, drafter, verifier_dir: str, prompts, progress: bool):
    say(f"measuring {len(prompts)} prompts x {cfg.max_new_tokens} tokens by speculative decoding in this process, "
        f"k={cfg.num_speculative_tokens} ...")
    verifier = hf_model.load_causal_lm(verifier_dir, dtype=torch.float32)
    eos = GenerationConfig.from_model_config(verifier.config).eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return measure_chain(verifier, drafter, prompts, k=cfg.num_speculative_tokens,
                         max_new_tokens=cfg.max_new_tokens, eos_token_ids=eos_ids, progress=progress)


def _measure(cfg: EvaluateConfig, backend: str, drafter, verifier_dir: str, records, progress: bool):
    """Measured acceptance: ``(ChainResult, prompts used, in-process cross-check or None)``."""
    prompts = prompts_of(records)[: cfg.max_prompts]
    if not prompts:
        raise DataError("the evaluation set has no sample with a prompt before its first assistant token")
    speed_at = cfg.speed_at
    if backend == "vllm-endpoint":
        assert cfg.vllm_endpoint is not None  # backend_of chose it for the endpoint
        model = cfg.vllm_model or served_models(cfg.vllm_endpoint)[0]  # the server's first, as --help says
        served = measure_vllm(cfg.vllm_endpoint, model, prompts, max_new_tokens=cfg.max_new_tokens,
                              concurrency=cfg.concurrency, progress=progress)
        if cfg.plain_endpoint and speed_at:
            plain = (cfg.plain_endpoint, served_models(cfg.plain_endpoint)[0])
            served.speeds = measure_speed((cfg.vllm_endpoint, model), plain, prompts,
                                          max_new_tokens=cfg.max_new_tokens, concurrencies=speed_at,
                                          level=cfg.confidence, progress=progress)
        elif speed_at:
            say("speed-up not measured: pass --plain-endpoint (the same verifier served without a drafter)")
        return served, len(prompts), None
    if backend == "vllm":
        served = measure_loopback(drafter, verifier_dir, prompts, k=cfg.num_speculative_tokens,
                                  max_new_tokens=cfg.max_new_tokens, concurrency=cfg.concurrency,
                                  progress=progress, speed_at=speed_at, sweep=cfg.sweep,
                                  confidence=cfg.confidence)
        cross = _in_process(cfg, drafter, verifier_dir, prompts, progress) if cfg.cross_check else None
        return served, len(prompts), cross
    if speed_at:
        say("speed-up not measured: decoding in this process times transformers, not what vLLM serves")
    return _in_process(cfg, drafter, verifier_dir, prompts, progress), len(prompts), None


def _say_lossless(chain, n_prompts: int) -> None:
    bf16 = chain.lossless_rule != "identical"
    if chain.mismatches:
        first = chain.mismatches[0]
        n, where = len(chain.mismatches), (f"first: prompt {first['prompt']}, token {first['position']}: verifier "
                                           f"{first['expected']}, got {first['got']}")
        if not bf16:
            say(f"BUG: speculative decoding changed the output on {n} of {n_prompts} prompts ({where}); greedy "
                "speculative decoding must be lossless")
        elif chain.lossless:
            say(f"lossless in bf16: {n} of {n_prompts} outputs differed beyond a near tie ({where}), no more than "
                f"the plain server's own bf16 noise allows ({chain.allowed_mismatches})")
        else:
            say(f"speculative decoding changed the output beyond a near tie on {n} of {n_prompts} prompts ({where}), "
                f"more than the plain server's own bf16 noise allows ({chain.allowed_mismatches}): look at these "
                "prompts before trusting the drafter")
    if chain.near_ties:
        say(f"lossless in bf16: {len(chain.near_ties)} of {n_prompts} outputs left the plain server's at a near "
            f"tie (each token among the other's top {TOP_LOGPROBS} choices), as bf16 decoding does under another "
            "batching")


def run(cfg: EvaluateConfig, *, progress: bool | None = None) -> EvaluateResult:
    """Evaluate ``cfg.target`` on ``cfg.data``; returns the headline numbers and the run id. SIGTERM/SIGINT stop
    it with exit 143/130 and one line: the metrics are logged in one go at the end, so a stopped evaluation
    logged nothing (its run, if it had opened one, ends KILLED)."""
    stopped = lambda name: (f"evaluate stopped by {name}; nothing was logged on the drafter: run it again with "  # noqa: E731
                            f"{same_command()}")
    with interrupt_on_signals(stopped):
        return _run(cfg, progress=progress)


def _run(cfg: EvaluateConfig, *, progress: bool | None = None) -> EvaluateResult:
    progress = sys.stderr.isatty() if progress is None else progress
    tracking.setup()
    client = tracking.client()
    # every input is checked before the run exists: a typo leaves no failed run behind
    data = open_prepared(resolve_data(cfg.data), verify=True)
    manifest = data.manifest
    data_name = dataset_name(client, cfg.data)
    verifier_dir = _verifier(cfg, manifest)
    hf_model.trust_as_recorded(verifier_dir, manifest.get("verifier_trust_remote_code"))
    target = resolve_target(cfg.target, cache=work_dir() / "cache", checkpoint=cfg.checkpoint,
                            experiment_id=tracking.experiment_id(), aux_convention=cfg.parent_aux_convention,
                            verifier_layers=int(hf_model.load_text_config(verifier_dir).num_hidden_layers))
    drafter = load_drafter(target, verifier_dir, manifest["aux_layer_ids"], ttt_steps=cfg.num_speculative_tokens)
    backend = backend_of(cfg, verifier_dir, mla_drafter=is_mla_drafter(drafter))
    records = data.records()

    tf = measure(drafter, records, ttt_steps=cfg.num_speculative_tokens, tokens_per_batch=cfg.tokens_per_batch,
                 progress=progress)
    metrics = {f"eval/teacher_forced/{k}": v for k, v in tf.items() if not k.startswith("loss")}
    chain, n_prompts, cross = (_measure(cfg, backend, drafter, verifier_dir, records, progress) if cfg.measured
                               else (None, 0, None))
    interval = None
    if chain is not None:
        metrics.update(_predicted(cfg, drafter, records, manifest, chain.acceptance_length, progress,
                                   outputs=chain.outputs or None, per_prompt=chain.per_prompt))
        interval = _measured_metrics(cfg, chain, n_prompts, cross, backend, metrics)
    run_id = _log_evaluation(cfg, target, data_name, manifest, metrics, chain, n_prompts, backend)
    return EvaluateResult(
        run_id=run_id, target=target.name, data=f"{data_name} ({manifest['digest'][:12]})",
        teacher_forced_acceptance_length=round(tf["acceptance_length"], 4),
        teacher_forced_walk_acceptance_length=round(tf["walk_acceptance_length"], 4),
        measured=None if chain is None else _measured_summary(cfg, chain, n_prompts, cross, backend, metrics,
                                                               interval))


def _measured_metrics(cfg: EvaluateConfig, chain, n_prompts: int, cross, backend: str, metrics: dict):
    """vLLM's (or the in-process chain's) figures into ``metrics``, with the interval over prompts, the
    recommended k and the lossless verdict said; returns the interval (None without per-prompt evidence)."""
    if cross is not None:  # the in-process chain beside vLLM's figure, on the same prompts
        metrics.update({f"eval/inprocess/{k}": v for k, v in cross.metrics().items()})
        metrics["eval/inprocess/acceptance_length_difference"] = chain.acceptance_length - cross.acceptance_length
    metrics.update({f"eval/measured/{k}": v for k, v in chain.metrics().items()})
    metrics[names.MEASURED_PROMPTS] = float(n_prompts)
    interval = None
    if chain.per_prompt:
        interval = acceptance_interval(chain.per_prompt, level=cfg.confidence)
        metrics.update({names.MEASURED_LOW: interval.low,
                        names.MEASURED_HIGH: interval.high,
                        names.MEASURED_CONFIDENCE: cfg.confidence})
        say(f"measured {interval.text()} on {interval.n} prompts ({cfg.confidence:.0%} interval, "
            f"width {interval.width:.2f}; {backend})")
    metrics.update(speed_metrics(chain.speeds))
    for speed in chain.speeds:
        verdict = (": from one wave, not shown faster here" if speed.speedup.n < 2 else
                   "" if speed.speedup.low > 1.0 else
                   ": slower here" if speed.speedup.high < 1.0 else ": not shown faster here")
        say(f"speed with the drafter: {speed.text()}" + (verdict and f"{verdict} (on a GPU deployment it must pay: "
                                                          "DRAFTLINE_REGISTRY_POLICIES=registry_policies/gpu gates on it)"))
    guessed = recommend_num_speculative_tokens(chain.per_position_rates, cfg.draft_cost_ratio)
    metrics[names.RECOMMENDED_K] = float(guessed)
    if chain.sweep:
        metrics.update(sweep_metrics(chain.sweep))
        fastest = fastest_k(chain.sweep)
        metrics[names.RECOMMENDED_K] = float(fastest)
        say(f"num_speculative_tokens: k={fastest} decodes fastest here ({sweep_text(chain.sweep)}); the cost "
            f"model, at --draft-cost-ratio {cfg.draft_cost_ratio}, would have guessed k={guessed}")
    metrics[names.RECOMMENDED_K_MEASURED] = float(bool(chain.sweep))
    _say_lossless(chain, n_prompts)
    return interval


def _log_evaluation(cfg: EvaluateConfig, target, data_name: str, manifest: dict, metrics: dict, chain,
                    n_prompts: int, backend: str) -> str:
    """The evaluate run: params, the evaluation set as its input, the metrics (also on the drafter's
    LoggedModel), the result file and the per-prompt evidence; returns its id."""
    dataset = lineage.data_set(manifest, data_name)
    tags = {**lineage.vllm_tags(), "draftline.evaluate.target": cfg.target, "draftline.evaluate.kind": target.kind,
            "draftline.evaluate.data": f"{data_name} {manifest['digest'][:12]}"}
    if target.run_id:
        tags.update({TARGET_RUN_TAG: target.run_id, TARGET_STEP_TAG: str(target.step)})
    short = target.name if len(target.name) <= 40 else target.name[:37] + "..."
    with tracking.stage_run("evaluate", run_name=f"evaluate {short} on {data_name}", tags=tags) as active:
        tracking.log_params_once({
            "target": cfg.target, "target.kind": target.kind, "target.sha256": target.sha256,
            "target.layout": target.layout, "checkpoint": cfg.checkpoint if target.run_id else "none",
            names.DATA_DIGEST: manifest["digest"], names.DATA_NAME: data_name, names.DATA_URI: cfg.data,
            **lineage.verifier_params(manifest),
            "num_speculative_tokens": cfg.num_speculative_tokens, "max_new_tokens": cfg.max_new_tokens,
            "prompts": n_prompts, "backend": backend, "draft_cost_ratio": cfg.draft_cost_ratio})
        mlflow.log_input(dataset, context="evaluation", tags=lineage.data_set_tags(manifest))
        mlflow.log_metrics(metrics, step=0)
        if target.model_id:  # onto the drafter's LoggedModel, linked to the evaluation set
            mlflow.log_metrics(metrics, step=0, model_id=target.model_id, dataset=dataset)
        result = {"target": cfg.target, "target_name": target.name, "kind": target.kind, "model_id": target.model_id,
                  "finetune_run_id": target.run_id, "step": target.step,
                  "data": {"name": data_name, "digest": manifest["digest"], "source": manifest["source"],
                           "uri": cfg.data},
                  "metrics": metrics, "mismatches": chain.mismatches[:100] if chain else []}
        with tempfile.TemporaryDirectory(prefix="draftline-evaluate-") as tmp:
            (Path(tmp) / RESULT_FILE).write_text(json.dumps(result, indent=2) + "\n")
            mlflow.log_artifact(str(Path(tmp) / RESULT_FILE))
            if chain is not None and chain.per_prompt:  # what a later comparison pairs prompt by prompt
                (Path(tmp) / PER_PROMPT_FILE).write_text("".join(json.dumps(r) + "\n" for r in chain.per_prompt))
                mlflow.log_artifact(str(Path(tmp) / PER_PROMPT_FILE))
    return active.info.run_id


def _measured_summary(cfg: EvaluateConfig, chain, n_prompts: int, cross, backend: str, metrics: dict,
                      interval) -> Measured:
    """The measured half of what evaluate prints."""
    return Measured(
        measured_acceptance_length=round(chain.acceptance_length, 4),
        acceptance_rate_per_position=[round(r, 4) for r in chain.per_position_rates],
        lossless=chain.lossless if chain.lossless_checked else None, prompts=n_prompts, backend=backend,
        recommended_num_speculative_tokens=int(metrics[names.RECOMMENDED_K]),
        recommended_from=(f"measured speed at concurrency {lowest(chain.sweep)}" if chain.sweep
                          else f"cost model (draft cost ratio {cfg.draft_cost_ratio})"),
        predicted_acceptance_length=round(metrics[names.PREDICTED], 4) if names.PREDICTED in metrics else None,
        inprocess_acceptance_length=round(cross.acceptance_length, 4) if cross is not None else None,
        measured_interval=[round(interval.low, 4), round(interval.high, 4)] if interval is not None else None,
        confidence=cfg.confidence if interval is not None else None,
        speedup=speed_summary(chain.speeds) if chain.speeds else None,
        sweep={f"k{k}": speed_summary(v) for k, v in sorted(chain.sweep.items())} if chain.sweep else None)


def evaluations_for(client, finetune_run_id: str, step: int | None) -> list[dict]:
    """The evaluations of finetune run ``finetune_run_id`` at checkpoint ``step``: the newest per evaluation set,
    newest first (what export carries onto the version it registers)."""
    filt = f"tags.`{TARGET_RUN_TAG}` = '{finetune_run_id}' and attributes.status = 'FINISHED'"
    if step is not None:
        filt += f" and tags.`{TARGET_STEP_TAG}` = '{step}'"
    exp = client.get_run(finetune_run_id).info.experiment_id
    out, seen = [], set()
    for r in client.search_runs([exp], filter_string=filt, order_by=["attributes.start_time DESC"], max_results=50):
        try:
            result = json.loads(Path(mlflow.artifacts.download_artifacts(
                run_id=r.info.run_id, artifact_path=RESULT_FILE)).read_text())
        except Exception:  # noqa: BLE001
            log.warning("evaluation run %s has no readable %s; skipped", r.info.run_id, RESULT_FILE)
            continue
        if result["data"]["digest"] not in seen:
            seen.add(result["data"]["digest"])
            out.append({**result, "run_id": r.info.run_id})
    return out


def attach(found: list[dict], model_id: str) -> None:
    """Log ``found`` evaluations onto LoggedModel ``model_id``, each linked to its evaluation set."""
    for result in found:
        d = result["data"]
        dataset = lineage.data_set({"source": d["source"], "digest": d["digest"]}, d["name"])
        mlflow.log_metrics(result["metrics"], step=0, model_id=model_id, dataset=dataset)
        carry_per_prompt(result["run_id"], d["digest"])  # beside the metrics now pointing at this run
