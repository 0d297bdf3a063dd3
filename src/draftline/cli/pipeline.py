"""``main``: prepare -> finetune -> export as MLflow project runs nested under one parent run.

As in MLflow's multistep example, a finished step is reused when its entry point, its parameters (compared as
the strings MLflow stores), the git commit and its upstream run ids all match; ``use_cache=False`` reruns all.
"""

from __future__ import annotations

import logging

import mlflow
from mlflow.utils.mlflow_tags import MLFLOW_GIT_COMMIT, MLFLOW_PROJECT_ENTRY_POINT

from draftline import names, tracking
from draftline.config import project_root
from draftline.errors import DraftlineError, TrainingError
from draftline.registry import lineage
from draftline.results import MainResult

log = logging.getLogger(__name__)


def _find_finished(client, experiment_id: str, entry_point: str, params: dict[str, str], commit: str | None):
    runs = client.search_runs([experiment_id], filter_string=f"tags.`{MLFLOW_PROJECT_ENTRY_POINT}` = "
                                                             f"'{entry_point}' and attributes.status = 'FINISHED'",
                              order_by=["attributes.start_time DESC"], max_results=200)
    for run in runs:
        if commit and run.data.tags.get(MLFLOW_GIT_COMMIT) != commit:
            continue
        if all(run.data.tags.get(f"draftline.param.{k}") == v for k, v in params.items()):
            return run
    return None


def _step(client, experiment_id, entry_point: str, params: dict[str, object], commit, use_cache: bool) -> str:
    root = project_root()
    if root is None:
        raise DraftlineError("main chains the MLproject entry points and runs from a draftline checkout; run "
                             "the stages one by one (draftline prepare, finetune, export) with an installed wheel")
    as_text = {k: str(v) for k, v in params.items()}
    if use_cache:
        hit = _find_finished(client, experiment_id, entry_point, as_text, commit)
        if hit:
            log.info("reusing %s run %s (same parameters, commit and upstream runs)", entry_point, hit.info.run_id)
            return hit.info.run_id
    submitted = mlflow.projects.run(str(root), entry_point=entry_point, parameters=as_text,
                                    env_manager="local", experiment_id=experiment_id, synchronous=False)
    for k, v in as_text.items():  # the exact strings asked for, so the cache compares like with like
        client.set_tag(submitted.run_id, f"draftline.param.{k}", v)
    if not submitted.wait():
        raise TrainingError(f"the {entry_point} step failed (run {submitted.run_id}); see its output above")
    return submitted.run_id


def run_main(*, conversations: str, verifier: str, init: str, registered_model: str,
             extra: dict[str, dict[str, str]] | None = None, use_cache: bool = True) -> MainResult:
    extra = extra or {}
    tracking.setup()
    client = tracking.client()
    commit: str | None = lineage.git_commit().removesuffix("-dirty")  # what MLflow records as mlflow.source.git.commit
    commit = None if commit == "unknown" else commit
    with tracking.stage_run("main", run_name="main") as parent:
        exp = parent.info.experiment_id
        prep = _step(client, exp, "prepare", {"conversations": conversations, "verifier": verifier,
                                              **extra.get("prepare", {})}, commit, use_cache)
        ft = _step(client, exp, "finetune", {"data": f"runs:/{prep}/data", "init": init,
                                             **extra.get("finetune", {})}, commit, use_cache)
        ex = _step(client, exp, "export", {"run": ft, "registered_model": registered_model,
                                           **extra.get("export", {})}, commit, use_cache=False)
        version = client.get_run(ex).data.tags.get(names.MODEL_VERSION, "")
        mlflow.set_tags({names.PREPARE_RUN: prep, names.FINETUNE_RUN: ft,
                         names.EXPORT_RUN: ex, names.MODEL_VERSION: version})
    return MainResult(prepare_run_id=prep, finetune_run_id=ft, export_run_id=ex, model_version=version)
