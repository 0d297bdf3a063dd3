"""Where the tracking store is and whether it answers: ``MLFLOW_TRACKING_URI`` or the local ``mlflow.db``, and
a server's ``/health``. Light (the standard library and requests, MLflow's own HTTP client), so a command
refuses an unreachable server before MLflow loads; :mod:`draftline.tracking` does the rest."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import url2pathname

import requests

from draftline import names
from draftline.errors import DataError, ServerUnavailable, TrackingError

__all__ = ["check_reachable", "check_runs", "check_store", "require_store", "store_path", "tracking_uri"]


_HOST_PORT = re.compile(r"[A-Za-z0-9.-]+:\d{1,5}(/.*)?")


def tracking_uri() -> str:
    """``MLFLOW_TRACKING_URI``, else an absolute ``sqlite:///<cwd>/mlflow.db`` (MLflow 3's default store). A
    server named without its scheme (``mlflow:5000``) is refused naming the scheme it lacks."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri and _HOST_PORT.fullmatch(uri):
        raise TrackingError(f"MLFLOW_TRACKING_URI={uri} names no scheme: a tracking server is http://{uri} (or "
                            "https://), a local store sqlite:////abs/path/mlflow.db")
    if uri:
        return uri
    return f"sqlite:///{Path.cwd().resolve() / 'mlflow.db'}"


_ANSWERED: dict[str, float] = {}  # server URI -> when it last answered /health (monotonic seconds)
ANSWER_FRESH_S = 5.0  # a command checks its server before MLflow loads, then again as it sets MLflow up: once


def check_reachable(uri: str | None = None) -> None:
    """A tracking server (http/https) that does not answer is one :class:`ServerUnavailable` line; a local store
    is not checked here. A server that answered in the last :data:`ANSWER_FRESH_S` seconds is not asked again."""
    uri = uri or tracking_uri()
    if not uri.startswith(("http://", "https://")):
        return
    if time.monotonic() - _ANSWERED.get(uri, -ANSWER_FRESH_S) < ANSWER_FRESH_S:
        return
    try:
        requests.get(uri.rstrip("/") + "/health", timeout=10.0)
        _ANSWERED[uri] = time.monotonic()
    except requests.RequestException as e:
        raise ServerUnavailable(
            f"the MLflow tracking server at {uri} is unreachable ({type(e).__name__}). Start it, or point "
            "MLFLOW_TRACKING_URI at a running server (unset it to use the local sqlite store)"
        ) from None


def store_path(uri: str) -> Path | None:
    """The local file or folder a tracking URI names (``sqlite:///…``, ``file:…``, a bare path), else None
    (a server, an in-memory sqlite). Parsed as SQLAlchemy and MLflow parse them: ``sqlite:///mlflow.db`` is
    relative to the working directory, ``sqlite:////abs/mlflow.db`` absolute."""
    if uri.startswith("sqlite:"):
        from sqlalchemy.engine import make_url  # noqa: PLC0415 (a sqlite store needs SQLAlchemy; a serving host with the light install talks to a server)

        database = make_url(uri).database
        return Path(database) if database and database != ":memory:" else None
    if uri.startswith("file:"):
        return Path(url2pathname(urlparse(uri).path))
    if "://" not in uri and not uri.startswith(("databricks", "uc:")):
        return Path(uri)
    return None


def require_store(uri: str | None = None) -> str:
    """For commands that only read: refuse a local tracking store that does not exist (MLflow would create an
    empty one, then find nothing in it)."""
    uri = uri or tracking_uri()
    path = store_path(uri)
    if path is not None and not path.exists():
        raise TrackingError(f"no tracking store at {uri} (nothing was created): run this where your mlflow.db is, "
                            "or point MLFLOW_TRACKING_URI at your store or server, e.g. export "
                            "MLFLOW_TRACKING_URI=http://mlflow.example:5000 or sqlite:////abs/path/mlflow.db")
    return uri


def check_store(*, read_only: bool) -> str:
    """What a command can check of its tracking store before MLflow loads: a local store exists (``read_only``
    commands: they never create one) and a server answers. Returns the URI."""
    uri = tracking_uri()
    if read_only:
        require_store(uri)
    check_reachable(uri)
    return uri


def check_runs(refs: dict[str, str | None], *, finished: bool = True) -> None:
    """The runs a command's flags name (``{"--data": "runs:/<id>/data", "--run": "<id>"}``), checked before
    any stage loads: a local store that does not exist holds none (refused at once, nothing created); otherwise
    each is asked for once: one that does not exist, or (``finished``) one that did not finish, is one
    :class:`DataError` line naming the flag and the fix."""
    named = {flag: run_id for flag, ref in refs.items() if (run_id := _run_id(ref))}
    if not named:
        return
    uri = tracking_uri()
    path = store_path(uri)
    if path is not None and not path.exists():
        flag, run_id = next(iter(named.items()))
        raise TrackingError(f"{flag} names run {run_id}, and there is no tracking store at {uri} to hold it "
                            "(nothing was created): run this where your mlflow.db is, or point MLFLOW_TRACKING_URI "
                            "at your store or server")
    check_reachable(uri)
    from mlflow import MlflowClient  # noqa: PLC0415 (only where a run is named: MLflow takes ~2 s to load)
    from mlflow.exceptions import MlflowException  # noqa: PLC0415 (as above)

    from draftline.mlflow_errors import absent, raise_failure  # noqa: PLC0415 (as above: it loads MLflow)

    client = MlflowClient(tracking_uri=uri)
    for flag, run_id in named.items():
        try:
            run = client.get_run(run_id)
        except MlflowException as e:
            if absent(e):
                raise DataError(f"{flag}: run {run_id} does not exist in {uri}: pass the run id the stage "
                                "printed (`draftline list` and the MLflow UI show them)") from None
            raise_failure(e, f"read run {run_id} ({flag})", "READ permission on the run's experiment")
        if finished and run.info.status != "FINISHED":
            step = run.data.tags.get(names.STEP, "its stage")
            raise DataError(f"{flag}: run {run_id} ({step}) is {run.info.status}, not FINISHED: rerun or resume "
                            "it, then pass it again")


def _run_id(ref: str | None) -> str | None:
    """The run id a ``runs:/<id>/...`` URI or a bare 32-hex run id names, else None (a directory, a models:/)."""
    if not ref:
        return None
    if ref.startswith("runs:/"):
        return ref[len("runs:/"):].strip("/").partition("/")[0] or None
    return ref if len(ref) == 32 and all(c in "0123456789abcdef" for c in ref) else None
