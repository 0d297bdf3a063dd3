"""The export stage as one MLflow run: take the finetune run's handed-on weights, rebuild the drafter
(``rebuild``), write the directory vLLM loads as it is (``directory``), validate it (``validate``), upload it
with its checksums (``upload``, and SpecForge's layout beside it: ``midlayer``), and register a version carrying
the lineage. Running out of room on the way is one clear error (``disk_space``)."""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from pathlib import Path

import mlflow
from mlflow.exceptions import MlflowException

from draftline import names, tracking
from draftline.config import ExportConfig
from draftline.console import say
from draftline.disk_space import in_store, in_tmp
from draftline.drafter.handoff import fetch_weights
from draftline.drafter.model import LAYER_FILE
from draftline.drafter.served import is_mla_drafter
from draftline.errors import DataError, DraftlineError
from draftline.evaluation.stage import attach, evaluations_for
from draftline.export.directory import serving_id, write_drafter
from draftline.export.midlayer import check_reload, write_midlayer
from draftline.export.rebuild import build_trained_model, local_verifier
from draftline.export.upload import upload_with_checksums
from draftline.export.validate import check_in_vllm, validate
from draftline.mlflow_errors import absent, raise_failure
from draftline.registry import lineage as lin
from draftline.registry import versions
from draftline.registry.policies import policy_set
from draftline.results import ExportResult
from draftline.serving import hf_model
from draftline.util import manifest_digest


def run(cfg: ExportConfig) -> ExportResult:
    """The export stage as one MLflow run: the version it registered."""
    tracking.setup()
    client = tracking.client()
    ft = _finished_finetune(client, cfg.run)
    ft_id, params = ft.info.run_id, ft.data.params
    hf_model.trust_as_recorded(local_verifier(params), params.get(names.VERIFIER_TRUST_REMOTE_CODE))
    metrics = {k: v for k, v in ft.data.metrics.items() if k in names.HEADLINE_METRICS}

    with tracking.stage_run("export", run_name="export",
                            tags={names.FINETUNE_RUN: ft_id, **lin.vllm_tags()}) as active, \
            tempfile.TemporaryDirectory(prefix="draftline-export-") as tmp_dir:
        tmp = Path(tmp_dir)
        model, lineage, step = _trained_drafter(ft, cfg, tmp)
        evaluated = evaluations_for(client, ft_id, step)
        k = _set_recommended_k(model, lineage, evaluated)
        out = _write_checked(model, lineage, metrics, evaluated, tmp / "drafter", verifier=local_verifier(params))
        vllm_check = check_in_vllm(cfg.vllm_check, out, local_verifier(params), k or int(params.get(names.TTT_STEPS, 3)),
                                   mla_drafter=is_mla_drafter(model))
        tracking.log_params_once({names.EXPORT_LAYOUT: cfg.layout, names.EXPORT_REGISTERED_MODEL: cfg.registered_model,
                                  names.EXPORT_CHECKPOINT: cfg.checkpoint, names.EXPORT_VLLM_CHECK: vllm_check,
                                  **{k: v for k, v in lineage.items() if k != "ttt_steps"}})
        model_id, manifest = _log_model(client, cfg, active, model, out, tmp, ft, lineage, metrics, evaluated)
        version = _register(client, cfg, active, model_id, manifest, lineage, metrics, vllm_check)
    return ExportResult(run_id=active.info.run_id, model_uri=f"models:/{cfg.registered_model}/{version}",
                        version=version)


def _finished_finetune(client, ref: str):
    """The finished finetune run ``ref`` names, or one error saying what it is instead."""
    ft_id = tracking.parse_run_ref(ref)[0]
    try:
        ft = client.get_run(ft_id)
    except MlflowException as e:
        if not absent(e):
            raise_failure(e, f"read finetune run {ft_id}", "READ permission on its experiment")
        raise DataError(f"finetune run {ft_id} does not exist on {tracking.tracking_uri()}") from None
    if ft.info.status != "FINISHED" or ft.data.tags.get(names.STEP) != "finetune":
        raise DataError(f"run {ft_id} is not a finished finetune run (status {ft.info.status}, step "
                        f"{ft.data.tags.get(names.STEP)}); export a finetune run that finished")
    return ft


def _trained_drafter(ft, cfg: ExportConfig, tmp: Path):
    """The checkpoint's drafter, rebuilt from the run's weights hand-off, and the lineage its version carries:
    ``(model, lineage, step)``."""
    params = ft.data.params
    with in_tmp(tmp):
        where, state, step = fetch_weights(ft, cfg.checkpoint, tmp / "weights")
    layer = json.loads((where / LAYER_FILE).read_text()) if (where / LAYER_FILE).is_file() else None
    model = build_trained_model(state, params, layer)
    del state
    shutil.rmtree(tmp / "weights", ignore_errors=True)
    lineage: dict[str, str] = {k: params[k] for k in names.VERSION_TAG_PARAMS if k in params}
    if step is not None:
        lineage[names.CHECKPOINT_STEP] = str(step)
    lineage[names.VERIFIER_NAME_OR_PATH] = serving_id(cfg, params)
    model.config.speculators_config.verifier.name_or_path = lineage[names.VERIFIER_NAME_OR_PATH]
    lineage.update({names.FINETUNE_RUN_ID: ft.info.run_id, names.TTT_STEPS: params.get(names.TTT_STEPS, "3")})
    return model, lineage, step


def _set_recommended_k(model, lineage: dict, evaluated: list[dict]) -> int | None:
    """The measured num_speculative_tokens, written where vLLM reads it (pull prints the same); None if unmeasured."""
    found = recommended_k(evaluated, policy_set())
    if not found:
        return None
    model.config.speculators_config.proposal_methods[0].speculative_tokens = found[0]
    lineage[names.EVAL_RECOMMENDED_K] = str(found[0])
    lineage[names.EVAL_RECOMMENDED_K_SET] = found[1]
    lineage[names.EVAL_RECOMMENDED_K_FROM] = found[2]
    return found[0]


def _write_checked(model, lineage: dict, metrics: dict, evaluated: list[dict], out: Path, *, verifier: str) -> Path:
    """The speculators-format directory vLLM serves, written to ``out`` and checked against the model."""
    try:
        with in_tmp(out):
            write_drafter(model, out, lineage, metrics, evaluated)
    except OSError as e:
        raise DraftlineError(f"cannot write the export to {e.filename or out} ({e.strerror}): point TMPDIR "
                             "at a writable directory") from None
    validate(model, out, verifier_path=verifier)
    return out


def _log_model(client, cfg: ExportConfig, active, model, out: Path, tmp: Path, ft, lineage: dict, metrics: dict,
               evaluated: list[dict]) -> tuple[str, dict]:
    """The drafter as an MLflow 3 LoggedModel (lineage as its params, the finetune run's metrics and the
    checkpoint's evaluations on it), READY only once every file is up; ``(model_id, checksums manifest)``."""
    params = ft.data.params
    logged = mlflow.initialize_logged_model(
        name=lin.logged_model_name(cfg.registered_model), source_run_id=active.info.run_id,
        model_type="eagle3-drafter", params={k: str(v) for k, v in lineage.items()},
        tags={names.KIND: "drafter", names.FINETUNE_RUN: ft.info.run_id})
    try:
        with in_store(logged.artifact_location):
            manifest = upload_with_checksums(out, logged.model_id)
            export_sha = manifest_digest(manifest)
        if cfg.layout == "midlayer" and is_mla_drafter(model):
            say("--layout midlayer: an MLA drafter is exported in the midlayer layout already; nothing beside it")
        elif cfg.layout == "midlayer":
            with in_tmp(tmp / "midlayer"):
                write_midlayer(model, tmp / "midlayer", params)
            check_reload(model, tmp / "midlayer", local_verifier(params))  # init=<that dir> gives these weights
            with in_store(f"{active.info.artifact_uri}/midlayer"):
                mlflow.log_artifacts(str(tmp / "midlayer"), artifact_path="midlayer")
        last = int(params.get(names.TRAIN_STEPS, 0))
        for key, v in metrics.items():  # the finetune run's final values, attached to the model
            client.log_metric(active.info.run_id, key, v, step=last, model_id=logged.model_id)
        attach(evaluated, logged.model_id)  # evaluations of this checkpoint, linked to their data sets
        mlflow.set_logged_model_tags(logged.model_id, {names.EXPORT_SHA256: export_sha, names.EXPORT_VALIDATED: "true"})
        mlflow.finalize_logged_model(logged.model_id, "READY")
    except BaseException:
        with contextlib.suppress(Exception):
            mlflow.finalize_logged_model(logged.model_id, "FAILED")
        raise
    return logged.model_id, manifest


def _register(client, cfg: ExportConfig, active, model_id: str, manifest: dict, lineage: dict, metrics: dict,
              vllm_check: str) -> str:
    """The registry version of the logged model, its lineage and checksums as tags; its number."""
    export_sha = manifest_digest(manifest)
    tags = {**lineage, names.EXPORT_SHA256: export_sha, names.EXPORT_VALIDATED: "true", names.EXPORT_VLLM_CHECK: vllm_check,
            "export.run_id": active.info.run_id, **versions.checksums_tag(manifest),
            **{f"metric.{k}": f"{v:.4f}" for k, v in metrics.items()}}
    mlflow.set_tags({names.EXPORT_SHA256: export_sha, names.EXPORT_VALIDATED: "true", names.MODEL_ID: model_id})
    description = versions.describe(lineage)
    version = versions.register(client, cfg.registered_model, model_id=model_id, run_id=active.info.run_id,
                                tags=tags, description=description)
    mlflow.set_tags({names.MODEL_VERSION: f"models:/{cfg.registered_model}/{version.version}",
                     "mlflow.runName": f"export → {cfg.registered_model} v{version.version}",
                     "mlflow.note.content": description})
    return str(version.version)


def recommended_k(evaluated: list[dict], preferred_set: str | None = None) -> tuple[int, str, str] | None:
    """``(num_speculative_tokens, the evaluation set it came from, how it was chosen)``: from the measured evaluation on
    ``preferred_set`` (the set the Production policy judges by: a name or a digest prefix) when there is one,
    else from the newest measured evaluation."""
    measured = [r for r in evaluated if names.RECOMMENDED_K in r["metrics"]]
    on_set = [r for r in measured if preferred_set and (r["data"]["name"] == preferred_set or (
        len(preferred_set) >= 8 and r["data"]["digest"].startswith(preferred_set)))]
    for result in on_set or measured:
        how = "measured speed (--sweep-k)" if result["metrics"].get(names.RECOMMENDED_K_MEASURED) else "cost model"
        return int(result["metrics"][names.RECOMMENDED_K]), result["data"]["name"], how
    return None
