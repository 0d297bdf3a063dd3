"""Finetune's live progress line, drawn by the launching process from rank 0's metrics (the lines the metrics
relay reads): ``step 12/40  loss 5.43  full_acc_0 0.231  acceptance 1.24 (val 1.06)  812 tok/s  ETA 0:21``.

On a terminal it is one line redrawn in place, other output printed above it; elsewhere (a log file, CI) a plain
line at the first step, then every ``DRAFTLINE_PROGRESS_S`` seconds (default 10), and at the last step.
"""

from __future__ import annotations

import sys
import threading
import time

from draftline import environment, names
from draftline.console import PREFIX


def _clock(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


class Progress:
    def __init__(self, total: int, stream=None, *, tty: bool | None = None, every_s: float | None = None,
                 clock=time.monotonic):
        self.total, self.stream, self.clock = total, stream or sys.stderr, clock
        if tty is None:
            try:
                tty = self.stream.isatty()
            except (AttributeError, ValueError):
                tty = False
        self.tty = tty
        self.every_s = environment.PROGRESS_S.get() if every_s is None else every_s
        self.live = ""  # the line on screen (a terminal only)
        self.val: float | None = None
        self.first: tuple[int, float] | None = None  # (step, time) of the first training line seen
        self.last_print: float | None = None
        self.lines = 0
        self._lock = threading.Lock()

    def update(self, record: dict) -> None:
        """One line of ``metrics.jsonl``: ``{"step", "timestamp", "metrics": {...}}``."""
        metrics, step = record.get("metrics", {}), int(record.get("step", 0))
        if names.VAL_ACCEPTANCE_LENGTH in metrics:
            self.val = metrics[names.VAL_ACCEPTANCE_LENGTH]
        if names.TRAIN_LOSS not in metrics:
            return
        now = self.clock()
        if self.first is None:
            self.first = (step, now)
        text = self.render(step, metrics, now)
        with self._lock:
            if self.tty:
                self.live = text
                self.stream.write("\r\x1b[K" + text)
                self.stream.flush()
            elif self.last_print is None or step >= self.total or now - self.last_print >= self.every_s:
                self.stream.write(text + "\n")
                self.stream.flush()
                self.last_print = now
            self.lines += 1

    def render(self, step: int, m: dict, now: float) -> str:
        parts = [f"step {step}/{self.total}", f"loss {m.get(names.TRAIN_LOSS, float('nan')):.3f}"]
        if names.TRAIN_FULL_ACC_0 in m:
            parts.append(f"full_acc_0 {m[names.TRAIN_FULL_ACC_0]:.3f}")
        if names.TRAIN_ACCEPTANCE_LENGTH in m:
            parts.append(f"acceptance {m[names.TRAIN_ACCEPTANCE_LENGTH]:.2f}"
                         + (f" (val {self.val:.2f})" if self.val is not None else ""))
        if names.TRAIN_TOKENS_PER_S in m:
            parts.append(f"{m[names.TRAIN_TOKENS_PER_S]:,.0f} tok/s")
        first_step, t0 = self.first or (step, now)
        if step >= self.total:
            parts.append(f"done in {_clock(now - t0)}" if step > first_step else "done")
        elif step > first_step:
            parts.append(f"ETA {_clock((self.total - step) * (now - t0) / (step - first_step))}")
        else:
            parts.append("ETA …")

        return PREFIX + "  ".join(parts)

    def write(self, text: str) -> None:
        """Other output (the ranks' lines): above the live line."""
        with self._lock:
            if self.tty and self.live:
                self.stream.write("\r\x1b[K" + text + ("" if text.endswith("\n") else "\n") + self.live)
            else:
                self.stream.write(text)
            self.stream.flush()

    def flush(self) -> None:
        self.stream.flush()

    def close(self) -> None:
        with self._lock:
            if self.tty and self.live:
                self.stream.write("\n")
                self.stream.flush()
                self.live = ""
