"""Where the tracking store is and whether it answers: ``MLFLOW_TRACKING_URI`` or the local ``mlflow.db``, and
a server's ``/health``. Light (the standard library and requests, MLflow's own HTTP client), so a command
refuses an unreachable server before MLflow loads; :mod:`draftline.tracking` does the rest."""

from __future__ import annotations

import os
import time
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import url2pathname

import requests

from draftline.errors import ServerUnavailable, TrackingError

__all__ = ["check_reachable", "check_store", "require_store", "store_path", "tracking_uri"]


def tracking_uri() -> str:
    """``MLFLOW_TRACKING_URI``, else an absolute ``sqlite:///<cwd>/mlflow.db`` (MLflow 3's default store)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
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
