"""What the user sees of the ranks' output: everything goes to ``ranks.log`` in the work directory; stderr gets
the progress lines but not the ranks' Python tracebacks (N ranks would print N of them before the one message
the launcher raises). ``DRAFTLINE_VERBOSE=1`` shows everything."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

_PREFIX = re.compile(r"^(\[rank\d+\]:\s?)")  # torch.distributed prefixes a rank's lines with [rankN]:
_END = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b.*|^[A-Za-z_][\w.]*: ")


class RankOutput:
    def __init__(self, log_path: Path, stream=None, verbose: bool | None = None):
        self.log = open(log_path, "a", encoding="utf-8", errors="replace")  # noqa: SIM115 (closed in close())
        self.stream = stream or sys.stderr
        self.verbose = os.environ.get("DRAFTLINE_VERBOSE", "") not in ("", "0") if verbose is None else verbose
        self.in_traceback = False
        self.hidden = 0

    def write(self, line: str) -> None:
        self.log.write(line)
        if self.verbose:
            self.stream.write(line)
            return
        body = _PREFIX.sub("", line)
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
