"""Riding out a tracking server that restarts: the loop that tries again while the server is unavailable
(:func:`~draftline.mlflow_errors.unavailable` says which failures those are).

MLflow's HTTP client already retries each request a few times (``MLFLOW_HTTP_REQUEST_MAX_RETRIES``, with
back-off), which covers a blip, not a server restart (tens of seconds here), and never a download cut off in
the middle of its body. Pulls and promotions therefore retry their own idempotent steps while the server is
unavailable, for up to ``DRAFTLINE_RETRY_S`` seconds (default 120), and then stop with one
:class:`~draftline.errors.ServerUnavailable` (exit 75: try again later). Nothing else is retried: a refused
checksum, a permission, a missing version are answered the same way every time.
"""

from __future__ import annotations

import logging
import os
import random
import time

from draftline import environment
from draftline.errors import ServerUnavailable
from draftline.mlflow_errors import unavailable

log = logging.getLogger(__name__)
RETRY_ENV = environment.RETRY_S.name


def budget_s() -> float:
    try:
        return environment.RETRY_S.get()
    except ValueError:
        return 120.0


def first_line(exc: BaseException) -> str:
    text = getattr(exc, "message", None) or str(exc) or type(exc).__name__
    return text.strip().splitlines()[0][:300]


def retrying(what: str, fn, *, budget: float | None = None):
    """``fn()``, called again after a pause while it fails because the server is unavailable, until the
    budget is spent; then :class:`ServerUnavailable` naming ``what``. Other failures pass through at once."""
    budget = budget_s() if budget is None else budget
    deadline, delay, tries = time.monotonic() + budget, 1.0, 0
    while True:
        tries += 1
        try:
            return fn()
        except Exception as e:  # noqa: BLE001  (every failure is judged: only the server's absence is retried)
            if not unavailable(e):
                raise
            if time.monotonic() + delay > deadline:
                uri = os.environ.get("MLFLOW_TRACKING_URI", "the tracking server")
                raise ServerUnavailable(
                    f"{uri} stopped answering while trying to {what} ({first_line(e)}); gave up after {tries} "
                    f"tries in {budget:.0f} s ({RETRY_ENV}). Nothing was left half-done: run the same command "
                    "again once the server is back") from None
            log.warning("the tracking server is unavailable (%s); trying to %s again in %.0f s", first_line(e),
                        what, delay)
            time.sleep(delay * (0.75 + random.random() / 2))
            delay = min(delay * 2, 8.0)
