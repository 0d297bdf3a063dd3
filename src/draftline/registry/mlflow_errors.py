"""What MLflow's failures say, read by their error codes: the one line of a failure, a refusal of this user, the
registry a message names, and the registered model a mistyped name was meant to be. Whether a failure is worth
another try (the server went away) is ``registry/retry.py``'s."""

from __future__ import annotations

import difflib

import mlflow


def mlflow_error(e: Exception) -> str:
    return getattr(e, "message", None) or str(e).splitlines()[0]


DENIED = ("PERMISSION_DENIED", "UNAUTHENTICATED", "CUSTOMER_UNAUTHORIZED")  # MLflow's codes for HTTP 403 and 401


def denied(e: Exception) -> bool:
    """The server refused this user (MLflow names a 403 or 401 by its error code, JSON body or not)."""
    return getattr(e, "error_code", "") in DENIED


def registry_uri() -> str:
    return mlflow.get_registry_uri()


def unknown_model_hint(client, name: str) -> str:
    """``; did you mean 'x'?`` when ``name`` is not a registered model and one is close; else ``""``."""
    try:
        client.get_registered_model(name)
        return ""
    except Exception:  # noqa: BLE001
        pass
    try:
        names = [m.name for m in client.search_registered_models()]
    except Exception:  # noqa: BLE001
        return ""
    near = difflib.get_close_matches(name, names, n=1)
    if near:
        return f"; did you mean {near[0]!r}?"
    return "; `draftline list` shows the registered models there" if names else "; it holds no registered models"
