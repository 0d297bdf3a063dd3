"""What the user sees of the ranks' output: everything goes to ``ranks.log`` in the work directory. On stderr,
at the default verbosity, only draftline's own lines (``[draftline] ...``); with ``-v`` (``DRAFTLINE_LOG=info``)
the launcher's and the ranks' lines too, but not the ranks' Python tracebacks (N ranks would print N of them
before the one message the launcher raises); ``-vv`` (``DRAFTLINE_LOG=debug``, or ``DRAFTLINE_VERBOSE=1``) shows
everything."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from draftline import console, environment

_PREFIX = re.compile(r"^(\[rank\d+\]:\s?)")  # torch.distributed prefixes a rank's lines with [rankN]:
_END = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b.*|^[A-Za-z_][\w.]*: ")
OWN = "[draftline]"  # console.PREFIX without its space


def _level(verbose: bool | None) -> str:
    if verbose is not None:
        return "debug" if verbose else "info"
    return "debug" if environment.VERBOSE.get() else console.level()


class RankOutput:
    def __init__(self, log_path: Path, stream=None, verbose: bool | None = None, level: str | None = None):
        self.log = open(log_path, "a", encoding="utf-8", errors="replace")  # noqa: SIM115 (closed in close())
        self.stream = stream or sys.stderr
        self.level = level or _level(verbose)
        self.in_traceback = False
        self.hidden = 0

    def write(self, line: str) -> None:
        self.log.write(line)
        self.log.flush()
        if self.level == "debug":
            self.stream.write(line)
            return
        body = _PREFIX.sub("", line)
        if self.level == "warning":
            if body.startswith(OWN):
                self.stream.write(body)
            return
        if body.startswith(("Traceback (most recent call last)", "During handling of the above exception",
                            "The above exception was the direct cause")):
            self.in_traceback = True
            self.hidden += 1
            return
        if self.in_traceback:
            if body[:1] not in (" ", "\t", "\n", "") and _END.match(body.rstrip("\n")):
                self.in_traceback = False  # the exception line ends the block: hidden as well
            return
        self.stream.write(line)

    def close(self) -> None:
        self.log.close()
