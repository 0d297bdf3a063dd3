"""Metrics from rank 0 to MLflow through a local file, so a tracking server that goes away never stops training.

Rank 0 appends each batch of metrics to ``metrics.jsonl`` in the work directory (:class:`MetricsFile`, with
``log_batch`` as ``MlflowClient`` has it) and never talks to MLflow; the launching process tails the file
(:class:`Relay`, a thread) and delivers each line with retries, remembering how far it got in
``metrics.jsonl.delivered``: lines written while the server is away are delivered when it returns, in order,
and a resumed run delivers what an earlier process could not. Only the launching process holds credentials.
Each new line also goes to ``on_line`` as it is read (finetune's progress line, :mod:`draftline.train.progress`).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from pathlib import Path

from mlflow.entities import Metric

from draftline import environment, tracking
from draftline.console import say


class MetricsFile:
    """Rank 0's sink: one JSON line per batch, ``{"step", "timestamp", "metrics": {name: value}}``."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def log_batch(self, run_id: str, metrics=()) -> None:  # the signature worker._log_metrics calls
        items = list(metrics)
        if not items:
            return
        line = {"step": int(items[0].step), "timestamp": int(items[0].timestamp),
                "metrics": {m.key: float(m.value) for m in items}}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
            f.flush()


class Relay:
    """The launching process's side: deliver ``path``'s complete lines to ``run_id``, retrying while the
    tracking server is away. ``close(wait_s)`` delivers the rest, waiting up to ``wait_s`` for the server."""

    def __init__(self, path: str | Path, run_id: str, poll_s: float = 0.5, on_line=None):
        self.path, self.run_id, self.poll_s = Path(path), run_id, poll_s
        self.mark = self.path.with_name(self.path.name + ".delivered")
        self.offset = int(self.mark.read_text() or 0) if self.mark.is_file() else 0
        self.on_line = on_line  # called once per new line, delivered or not (the progress line)
        self.seen = self.offset
        self.delivered = 0
        self.failures = 0
        self.outage_reported = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="draftline-metrics-relay", daemon=True)

    def __enter__(self) -> Relay:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _pending(self) -> list[tuple[int, dict]]:
        if not self.path.is_file():
            return []
        out = []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            pos = self.offset
            for raw in f:
                if not raw.endswith(b"\n"):
                    break  # rank 0 is still writing this line
                pos += len(raw)
                with contextlib.suppress(ValueError):
                    out.append((pos, json.loads(raw)))
                    if self.on_line is not None and pos > self.seen:
                        self.seen = pos
                        with contextlib.suppress(Exception):  # a display must never stop the relay
                            self.on_line(out[-1][1])
        return out

    def deliver_once(self) -> bool:
        """Deliver what is pending; False when the server refused or was away (the rest waits)."""
        client = tracking.client()
        for pos, line in self._pending():
            metrics = [Metric(k, v, line["timestamp"], line["step"]) for k, v in line["metrics"].items()]
            try:
                client.log_batch(self.run_id, metrics=metrics)
            except Exception as e:  # noqa: BLE001 (an outage: keep the line, try again later)
                self.failures += 1
                if not self.outage_reported:
                    self.outage_reported = True
                    say(f"tracking server unreachable ({type(e).__name__}); training goes on, "
                          f"metrics wait in {self.path} and are delivered when it returns")
                return False
            self.offset = pos
            self.delivered += 1
            self.mark.write_text(str(pos))
        if self.outage_reported:
            self.outage_reported = False
            say("tracking server back: buffered metrics delivered")
        return True

    def _run(self) -> None:
        delay = self.poll_s
        while not self._stop.is_set():
            ok = self.deliver_once()
            delay = self.poll_s if ok else min(max(delay * 2, 1.0), 15.0)
            self._stop.wait(delay)

    def close(self, wait_s: float | None = None) -> bool:
        """Stop the thread, then deliver the rest, retrying up to ``wait_s`` (``DRAFTLINE_TRACKING_WAIT_S``,
        default 600 s). True when nothing is left undelivered."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        wait_s = environment.TRACKING_WAIT_S.get() if wait_s is None else wait_s
        deadline, delay = time.monotonic() + wait_s, 1.0
        while not self.deliver_once():
            if time.monotonic() >= deadline:
                say(f"some metrics are not delivered yet: they stay in {self.path} and are "
                      "delivered by `draftline finetune --resume` of this run")
                return False
            time.sleep(delay)
            delay = min(delay * 2, 15.0)
        return True
