"""MLflow plumbing shared by the stages: tracking URI, reachability, runs, params, artifacts.

Credentials (``MLFLOW_TRACKING_USERNAME``/``_PASSWORD``/``_TOKEN``) are read by MLflow from the environment
and never logged by draftline.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from pathlib import Path

import mlflow
from mlflow import MlflowClient
from mlflow.entities import Param
from mlflow.exceptions import MlflowException
from mlflow.tracking import fluent

from draftline import environment, names
from draftline.console import say
from draftline.errors import DataError, Interrupted, TrackingError
from draftline.mlflow_errors import denied, exists, refusal
from draftline.store import check_reachable, require_store, tracking_uri

EXPERIMENT_ENV = environment.EXPERIMENT.name
DEFAULT_EXPERIMENT = environment.EXPERIMENT.default


def client() -> MlflowClient:
    """The one place draftline makes its tracking client: MLflow's own, on the store :func:`setup` chose (or
    ``MLFLOW_TRACKING_URI``), with MLflow's credentials from the environment."""
    return MlflowClient()


def setup(experiment: str | None = None, *, select_experiment: bool = True) -> str:
    """Point MLflow at the tracking store, check it answers, select the experiment (not for the registry's
    commands: a deployment that only pulls needs no experiment, nor the right to create one). Returns the URI."""
    # MLflow warns about its own stage API on every call; draftline keeps stages in step with aliases on purpose
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"mlflow(\.|$)")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"draftline(\.|$)")
    uri = tracking_uri()
    mlflow.set_tracking_uri(uri)
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "3")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
    check_reachable(uri)
    if not select_experiment or os.environ.get("MLFLOW_RUN_ID"):  # under `mlflow run`: the run exists
        return uri
    try:
        if os.environ.get("MLFLOW_EXPERIMENT_ID"):  # set by a parent process (e.g. `draftline main`)
            mlflow.set_experiment(experiment_id=os.environ["MLFLOW_EXPERIMENT_ID"])
        else:
            name = experiment or environment.EXPERIMENT.get()
            try:
                exp = mlflow.set_experiment(name)
            except MlflowException as e:  # another process created it a moment ago: take theirs
                if not exists(e):
                    raise
                exp = mlflow.set_experiment(name)
            if "mlflow.experimentKind" not in exp.tags:  # the UI opens a training experiment on its runs
                _tag_experiment_kind(exp.experiment_id)
    except MlflowException as e:
        if denied(e):
            raise refusal(e, f"use experiment {experiment or environment.EXPERIMENT.get()}",
                          "EDIT permission on that experiment (or the right to create it)") from None
        raise TrackingError(f"cannot use the experiment on {uri}: {e}") from None
    return uri


def _tag_experiment_kind(experiment_id: str) -> None:
    """Mark the experiment as a training one (the UI opens it on its runs); a user who may only read it is not
    stopped by that: the tag is the UI's convenience, and the runs it cannot create are refused where they are."""
    try:
        client().set_experiment_tag(experiment_id, "mlflow.experimentKind", "custom_model_development")
    except MlflowException as e:
        if not denied(e) and "mlflow.experimentKind" not in client().get_experiment(experiment_id).tags:
            raise  # not a process starting beside us that set it first: a real error


def experiment_id() -> str:
    """The experiment this process logs to, as :func:`setup` selected it (under ``mlflow run``: its run's)."""
    if os.environ.get("MLFLOW_RUN_ID"):
        return client().get_run(os.environ["MLFLOW_RUN_ID"]).info.experiment_id
    if os.environ.get("MLFLOW_EXPERIMENT_ID"):
        return os.environ["MLFLOW_EXPERIMENT_ID"]
    name = environment.EXPERIMENT.get()
    experiment = mlflow.get_experiment_by_name(name)
    if experiment is None:
        raise TrackingError(f"no experiment {name} on {tracking_uri()}: run a stage first, or set {EXPERIMENT_ENV}")
    return experiment.experiment_id


def setup_read_only() -> str:
    """:func:`setup` for the commands that only read (no experiment selected, no store created)."""
    require_store()
    return setup(select_experiment=False)


def run_link(experiment_id: str, run_id: str, uri: str | None = None) -> str:
    """Where to see a run in the MLflow UI: the server's page, or (a local store) how to open the UI on it."""
    uri = uri or tracking_uri()
    page = f"#/experiments/{experiment_id}/runs/{run_id}"
    if uri.startswith(("http://", "https://")):
        return f"{uri.rstrip('/')}/{page}"
    return f"http://127.0.0.1:5000/{page} (after `mlflow ui --backend-store-uri {uri}`)"


@contextlib.contextmanager
def stage_run(step: str, run_name: str | None = None, tags: dict[str, str] | None = None,
              run_id: str | None = None, system_metrics: bool = False):
    """The MLflow run of one stage: the one ``mlflow run`` opened (``MLFLOW_RUN_ID``), or a new one.

    A stage that raises leaves its run FAILED, never RUNNING.
    """
    resuming = run_id or os.environ.get("MLFLOW_RUN_ID")
    try:
        run = mlflow.start_run(run_id=run_id, run_name=None if resuming else run_name,
                               nested=mlflow.active_run() is not None, log_system_metrics=system_metrics or None)
    except MlflowException as e:
        if denied(e):
            raise refusal(e, f"start the {step} run", "EDIT permission on the experiment it logs to") from None
        raise TrackingError(f"cannot start the {step} run on {tracking_uri()}: {e}") from None
    mlflow.set_tags({names.STEP: step, **(tags or {})})
    try:
        yield run
    except BaseException as e:
        end_run("KILLED" if isinstance(e, (Interrupted, KeyboardInterrupt)) else "FAILED")
        raise
    else:
        end_run("FINISHED")


def end_run(status: str, wait_s: float | None = None) -> None:
    """End the active run with ``status``; a tracking server that is away is retried for up to ``wait_s``
    (``DRAFTLINE_TRACKING_WAIT_S``, default 600 s), so an outage at the end does not leave the run RUNNING."""
    run = mlflow.active_run()
    if run is None:
        return
    run_id = run.info.run_id
    try:
        mlflow.end_run(status=status)  # pops the run, then tells the server
        return
    except Exception:  # noqa: BLE001 (the server is away: the run is popped; keep telling it)
        monitor = fluent.run_id_to_system_metrics_monitor.pop(run_id, None)  # its thread would log on
        if monitor is not None:
            monitor.finish()
    wait_s = environment.TRACKING_WAIT_S.get() if wait_s is None else wait_s
    deadline, delay = time.monotonic() + wait_s, 1.0
    say(f"the tracking server is unreachable; retrying to mark run {run_id} {status} for up to "
          f"{wait_s:.0f} s")
    while time.monotonic() < deadline:
        time.sleep(delay)
        delay = min(delay * 2, 15.0)
        try:
            client().set_terminated(run_id, status)
            return
        except Exception:  # noqa: BLE001
            continue
    say(f"could not mark run {run_id} {status}: {tracking_uri()} stayed unreachable; mark it with "
          f"`mlflow runs` or resume it")


def log_params_once(params: dict[str, object], run_id: str | None = None) -> None:
    """Log params; on a resumed run, skip those already logged with the same value (MLflow params are
    immutable) and refuse a changed value."""
    tracker = client()
    if run_id is None:
        active = mlflow.active_run()
        if active is None:
            raise TrackingError("no MLflow run to log params to: call this inside a stage's run")
        run_id = active.info.run_id
    existing = tracker.get_run(run_id).data.params
    fresh = {}
    for k, v in params.items():
        s = "" if v is None else str(v)
        if k in existing:
            if existing[k] != s[:6000]:
                raise DataError(f"run {run_id} already has {k}={existing[k]!r}; this run asks for {s!r}. "
                                "A resumed run cannot change its settings: start a new run instead")
            continue
        fresh[k] = s
    if fresh:
        items = [Param(k, v) for k, v in fresh.items()]
        for i in range(0, len(items), 100):
            tracker.log_batch(run_id, params=items[i : i + 100])


def parse_run_ref(ref: str) -> tuple[str, str | None]:
    """``runs:/ID/path`` -> (ID, path); a bare run id -> (ID, None)."""
    if ref.startswith("runs:/"):
        rest = ref[len("runs:/"):].strip("/")
        run_id, _, path = rest.partition("/")
        return run_id, path or None
    return ref, None


def download(uri: str, dest: Path | None = None) -> Path:
    """Download an MLflow artifact URI (``runs:/``, ``models:/``...) and return the local path."""
    try:
        local = mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(dest) if dest else None)
    except Exception as e:  # noqa: BLE001 (MLflow's, requests' or the disk's: one line either way)
        if denied(e):
            raise refusal(e, f"download {uri}", "READ permission on the run's experiment (or the model)") from None
        raise DataError(f"cannot download {uri}: {e}") from None
    return Path(local)
