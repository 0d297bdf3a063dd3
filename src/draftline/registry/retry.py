"""Riding out a tracking server that restarts: which failures are worth another try, and the loop that tries.

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
from draftline.errors import DraftlineError, ServerUnavailable

log = logging.getLogger(__name__)
RETRY_ENV = environment.RETRY_S.name
# what MLflow's and requests' messages say when the server went away (MLflow wraps most of them as text)
_SIGNS = ("max retries exceeded", "connection refused", "connection aborted", "connection reset",
          "remotedisconnected", "remote end closed", "connection broken", "incompleteread", "response ended prematurely",
          "chunkedencodingerror", "read timed out", "server disconnected", "bad gateway", "service unavailable",
          "gateway timeout", "status code 502", "status code 503", "status code 504", "too many 502",
          "too many 503", "too many 504", "temporarily unavailable")


def unavailable(exc: BaseException | None) -> bool:
    """True when ``exc`` (or an exception behind it) says the server could not be reached or hung up."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, ServerUnavailable):
            return True
        if isinstance(exc, DraftlineError):
            return False
        if isinstance(exc, ConnectionError | TimeoutError):
            return True
        name = type(exc).__name__
        if name in ("ChunkedEncodingError", "ProtocolError", "ConnectTimeout", "ReadTimeout", "IncompleteRead",
                    "RemoteDisconnected", "NewConnectionError", "MaxRetryError"):
            return True
        if any(sign in str(exc)[:4000].lower() for sign in _SIGNS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


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
        except Exception as e:  # noqa: BLE001
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
