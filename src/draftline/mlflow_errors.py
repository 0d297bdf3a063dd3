"""What MLflow's failures say, read by their error codes, in one place: a thing that is not there
(:func:`absent`, :func:`alias_unset`), one that already is (:func:`exists`), a refusal of this user
(:func:`denied`), a server that went away (:func:`unavailable`, what ``registry/retry.py`` tries again); any other
failure is an error, said as it is (:func:`raise_failure`). Also the one line of a failure, the registry a message
names, and the registered model a mistyped name was meant to be.

MLflow raises :class:`~mlflow.exceptions.MlflowException` (from a REST store, :class:`~mlflow.exceptions.RestException`)
with an ``error_code`` from ``mlflow.protos.databricks_pb2``, as its own stores match them; a request its REST client
could not complete carries the ``requests`` error behind it (``__context__``). Artifact downloads through the
server's proxy raise ``requests.HTTPError`` with the HTTP status instead.
"""

from __future__ import annotations

import difflib
import http.client
import os
from typing import NoReturn

import mlflow
import requests
import urllib3
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import (
    CUSTOMER_UNAUTHORIZED,
    DEADLINE_EXCEEDED,
    INTERNAL_ERROR,
    INVALID_PARAMETER_VALUE,
    NOT_FOUND,
    PERMISSION_DENIED,
    RESOURCE_ALREADY_EXISTS,
    RESOURCE_DOES_NOT_EXIST,
    SERVICE_UNDER_MAINTENANCE,
    TEMPORARILY_UNAVAILABLE,
    UNAUTHENTICATED,
    ErrorCode,
)

from draftline.errors import DraftlineError, ServerUnavailable, TrackingError


def _names(*codes: int) -> frozenset[str]:
    return frozenset(ErrorCode.Name(c) for c in codes)


# ENDPOINT_NOT_FOUND (a 404 without MLflow's JSON body: no such API there, a proxy's path) is not "absent"
ABSENT = _names(RESOURCE_DOES_NOT_EXIST, NOT_FOUND)
EXISTS = _names(RESOURCE_ALREADY_EXISTS)
DENIED = _names(PERMISSION_DENIED, UNAUTHENTICATED, CUSTOMER_UNAUTHORIZED)  # MLflow's codes for HTTP 403 and 401
UNAVAILABLE = _names(TEMPORARILY_UNAVAILABLE, DEADLINE_EXCEEDED, SERVICE_UNDER_MAINTENANCE)  # 503, 504, 500
GONE_STATUS = (502, 503, 504)  # an HTTP answer from a proxy whose server is away
# the server did not answer (or hung up mid-body); MLflow's REST client keeps them as the error behind its own,
# and raises RetryError once the statuses it retries (429, 5xx) kept coming back
GONE_TYPES = (ConnectionError, TimeoutError, http.client.IncompleteRead, requests.exceptions.ConnectionError,
              requests.exceptions.Timeout, requests.exceptions.ChunkedEncodingError, requests.exceptions.RetryError,
              urllib3.exceptions.ProtocolError, urllib3.exceptions.TimeoutError)
# The last resort: requests', urllib3's and http.client's words for a server that went away, read only in an
# MlflowException with INTERNAL_ERROR and nothing typed behind it (its artifact downloads gather each file's
# failure into one message, the errors themselves dropped).
GONE_WORDS = ("max retries exceeded", "connection refused", "connection aborted", "connection reset",
              "remotedisconnected", "remote end closed", "connection broken", "incompleteread",
              "response ended prematurely", "chunkedencodingerror", "read timed out", "bad gateway",
              "service unavailable", "gateway timeout")


def error_code(e: BaseException) -> str | None:
    """MLflow's error code of ``e`` (``RESOURCE_DOES_NOT_EXIST``, ...); None for a failure that is not MLflow's."""
    return e.error_code if isinstance(e, MlflowException) else None


def http_status(e: BaseException) -> int | None:
    """The HTTP status ``e`` answers with: MLflow's for its code, or the response's (``requests.HTTPError``)."""
    if isinstance(e, MlflowException):
        return e.get_http_status_code()
    return getattr(getattr(e, "response", None), "status_code", None)


def _is(e: BaseException, codes: frozenset[str], status: tuple[int, ...]) -> bool:
    code = error_code(e)
    return code in codes if code is not None else http_status(e) in status


def absent(e: BaseException) -> bool:
    """The thing asked for does not exist (RESOURCE_DOES_NOT_EXIST, NOT_FOUND; a download's HTTP 404)."""
    return _is(e, ABSENT, (404,))


def alias_unset(e: BaseException) -> bool:
    """``get_model_version_by_alias`` found no such alias: MLflow's stores answer an alias that is not set with
    INVALID_PARAMETER_VALUE (``Registered model alias X not found.``, after checking the alias's name, which
    draftline's aliases pass), and a model that is not there with RESOURCE_DOES_NOT_EXIST."""
    return absent(e) or error_code(e) == ErrorCode.Name(INVALID_PARAMETER_VALUE)


def exists(e: BaseException) -> bool:
    """What was to be created exists already (RESOURCE_ALREADY_EXISTS)."""
    return _is(e, EXISTS, ())


def denied(e: BaseException) -> bool:
    """The server refused this user (MLflow names a 403 or 401 by its error code, JSON body or not)."""
    return _is(e, DENIED, (401, 403))


def _gone(e: BaseException) -> bool | None:
    """What ``e``'s own type or code says about the server: gone (True), answered (False), or nothing (None)."""
    if isinstance(e, DraftlineError):
        return isinstance(e, ServerUnavailable)
    if isinstance(e, requests.exceptions.SSLError):  # a certificate does not get better by waiting
        return False
    if isinstance(e, GONE_TYPES):
        return True
    code = error_code(e)
    if code is not None:
        return True if code in UNAVAILABLE else None if code == ErrorCode.Name(INTERNAL_ERROR) else False
    status = http_status(e)
    return None if status is None else status in GONE_STATUS


def unavailable(e: BaseException | None) -> bool:
    """The server could not be reached or hung up: judged by the type or code of ``e`` or of the first error
    behind it that has one that says; by its words only where nothing typed says (:data:`GONE_WORDS`)."""
    chain, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        chain.append(e)
        verdict = _gone(e)
        if verdict is not None:
            return verdict
        e = e.__cause__ or e.__context__
    return any(any(w in str(x)[:4000].lower() for w in GONE_WORDS) for x in chain if isinstance(x, MlflowException))


def mlflow_error(e: Exception) -> str:
    return getattr(e, "message", None) or str(e).splitlines()[0]


def registry_uri() -> str:
    return mlflow.get_registry_uri()


def refusal(e: Exception, what: str, needs: str) -> TrackingError:
    """The one line for a refusal of this user: who, the permission ``needs`` names, and what it was for."""
    user = os.environ.get("MLFLOW_TRACKING_USERNAME", "this user")
    return TrackingError(f"permission denied: {user} lacks {needs}, needed to {what} on {registry_uri()} "
                         f"({mlflow_error(e)}); ask an MLflow admin for it")


def raise_failure(e: Exception, what: str, needs: str) -> NoReturn:
    """Raise a failure that does not mean what the caller can answer (absent, exists): ``e`` itself when the
    server went away (``retry.retrying`` tries again), :func:`refusal` when it refused this user, else one line
    with MLflow's message. ``what``: what was being done (``read registered model x``); ``needs``: the
    permission it takes (``READ permission on registered model x``)."""
    if unavailable(e):
        raise e
    if denied(e):
        raise refusal(e, what, needs) from None
    raise TrackingError(f"cannot {what} on {registry_uri()}: {mlflow_error(e)}") from None


def unknown_model_hint(client, name: str) -> str:
    """``; did you mean 'x'?`` when ``name`` is not a registered model and one is close; else ``""``."""
    try:
        client.get_registered_model(name)
        return ""
    except MlflowException as e:
        if not absent(e):  # it may exist: a hint would mislead
            return ""
    try:
        names = [m.name for m in client.search_registered_models()]
    except MlflowException:  # a hint is extra: a registry that does not list its models gives none
        return ""
    near = difflib.get_close_matches(name, names, n=1)
    if near:
        return f"; did you mean {near[0]!r}?"
    return "; `draftline list` shows the registered models there" if names else "; it holds no registered models"
