"""Every error a user can cause, with one base class.

The CLI catches :class:`DraftlineError`, prints its message (which names the thing, the flag and the fix)
and exits with ``exit_code``; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable


class DraftlineError(Exception):
    """Base of all expected failures. ``exit_code`` 1 is a runtime failure, 2 a usage error."""

    exit_code = 1


class UsageError(DraftlineError):
    """Raised when a flag, parameter or config value is malformed (exit 2)."""

    exit_code = 2


class ConfigError(UsageError):
    """Raised when a config or policy file is missing, unreadable or fails validation."""


class ParentNotFound(DraftlineError):
    """Raised when ``init`` names no catalog entry, directory, cached repo or registry version."""


class CheckpointError(DraftlineError):
    """Raised when a checkpoint is unreadable, has the wrong layout, or its keys/shapes do not fit the model."""


class ParentMismatch(CheckpointError):
    """Raised when the parent drafter was made for another verifier (hidden size, shapes): the user chose it, so
    a usage error."""

    exit_code = 2


class DataError(DraftlineError):
    """Raised when prepared data or input conversations are missing, malformed or for another verifier."""


class TrackingError(DraftlineError):
    """Raised when the MLflow tracking server cannot be reached or refuses a request."""


class ServerUnavailable(TrackingError):
    """Raised when the tracking server cannot be reached, or stopped answering and did not come back while
    the command retried (exit 75, EX_TEMPFAIL: the same command may well succeed later)."""

    exit_code = 75


class RegistryError(DraftlineError):
    """Raised when a registered model, version, stage or alias does not exist or cannot be changed."""


class VerificationError(DraftlineError):
    """Raised when a pulled or exported file does not match its manifest."""


class TrainingError(DraftlineError):
    """Raised when the DeepSpeed launcher or a training rank fails."""


class DiskFullError(DraftlineError):
    """Raised when a write fails for want of room: no space left (ENOSPC), a disk quota (EDQUOT), or a file
    larger than the process's file size limit or the file system allows (EFBIG)."""


class Interrupted(DraftlineError):
    """Raised when SIGTERM or SIGINT stopped a stage; the run ends KILLED and the message says how to resume.
    ``exit_code`` is the shell's for the signal (143 for SIGTERM, 130 for SIGINT)."""

    def __init__(self, message: str, signum: int = 15):
        super().__init__(message)
        self.exit_code = 128 + signum


def all_of(checks: Iterable[Callable[[], object]]) -> None:
    """Run every check and raise what they found at once: one mistake as it is, several as one error of the
    first one's kind (and exit code: usage over runtime) that lists them all, so a user fixes them in one go.
    A check that itself ran :func:`all_of` adds its mistakes one by one."""
    found: list[DraftlineError] = []
    for check in checks:
        try:
            check()
        except DraftlineError as e:
            found.extend(x for x in getattr(e, "problems", None) or [e] if str(x) not in map(str, found))
    if len(found) == 1:
        raise found[0]
    if found:
        code = max((e.exit_code for e in found if e.exit_code != ServerUnavailable.exit_code),
                   default=found[0].exit_code)
        kind = type(found[0]) if all(type(e) is type(found[0]) for e in found) else \
            UsageError if code == UsageError.exit_code else DraftlineError
        error = kind(f"{len(found)} problems: " + "; ".join(f"({i}) {e}" for i, e in enumerate(found, 1)))
        error.exit_code = code
        error.problems = found  # type: ignore[attr-defined]
        raise error
