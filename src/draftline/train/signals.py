"""Stopping a finetune on SIGTERM/SIGINT: every rank saves a checkpoint at the same step and exits, the run ends
KILLED, and the message says how to resume.

The DeepSpeed launcher runs in its own session, so a signal to ``draftline finetune`` (or to its process group:
``timeout``, Ctrl-C, Kubernetes, Slurm) reaches only the launching process, which asks the ranks to stop through
a stop file in the work directory (shared storage on a cluster, as the checkpoints are). Each step the ranks
all-reduce "stop requested" (the file, or a SIGTERM/SIGINT that reached a rank directly), so they save the
same step together. A second signal, or ranks still running ``DRAFTLINE_STOP_GRACE_S`` (default 600) after
the first, ends them at once through DeepSpeed's launcher.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from draftline import environment
from draftline.console import say
from draftline.util import SIGNALS, interrupt_on_signals


def resume_hint(run_id: str | None, *, per_node: bool = False) -> str:
    """The command that continues this run: the same flags, plus ``--resume RUN_ID`` (``per_node``: without this
    node's ``--node-rank``, which each node of the job passes for itself)."""
    args = [a for a in sys.argv[1:]]
    if per_node:
        args = [a for i, a in enumerate(args) if a != "--node-rank" and (i == 0 or args[i - 1] != "--node-rank")
                and not a.startswith("--node-rank=")]
    if run_id and "--resume" not in args:
        args += ["--resume", run_id]
    return "draftline " + shlex.join(args) if args else f"draftline finetune ... --resume {run_id}"


def stop_on_signals(what: str = "finetune"):
    """Turn SIGTERM/SIGINT into :class:`Interrupted` while ``what`` runs outside the ranks (resolving data,
    hashing, logging), so the MLflow run ends KILLED instead of the process vanishing with it RUNNING."""
    return interrupt_on_signals(lambda name: f"{what} stopped by {name} before training started")


class Stopper:
    """The launching process's side: on the first signal, write the stop file; on a second one, or after the
    grace period, terminate DeepSpeed's launcher (which terminates the ranks)."""

    def __init__(self, proc, stop_file: Path, grace_s: float | None = None, on_signal=None):
        self.proc, self.stop_file, self.on_signal = proc, Path(stop_file), on_signal
        self.grace_s = environment.STOP_GRACE_S.get() if grace_s is None else grace_s
        self.signum: int | None = None
        self._previous: dict = {}
        self._timer: threading.Timer | None = None

    def __enter__(self) -> Stopper:
        self.stop_file.unlink(missing_ok=True)
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        if self._timer:
            self._timer.cancel()
        self.stop_file.unlink(missing_ok=True)

    def _handle(self, signum, _frame) -> None:
        if self.signum is None:
            self.signum = signum
            self.stop_file.write_text(signal.Signals(signum).name + "\n")
            if self.on_signal:  # e.g. tell the job's other nodes (train.rendezvous)
                self.on_signal(signal.Signals(signum).name)
            say(f"{signal.Signals(signum).name}: the ranks save a checkpoint and stop after this "
                  f"step (send it again to stop at once)")
            self._timer = threading.Timer(self.grace_s, self.terminate)
            self._timer.daemon = True
            self._timer.start()
        else:
            say("second signal: ending the ranks now")
            self.terminate()

    def terminate(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGTERM)


def install_rank_handlers() -> dict[str, bool]:
    """A rank's side: a SIGTERM/SIGINT that reaches the rank itself only marks the request (the loop saves
    and exits at the end of the step)."""
    stop = {"now": False}
    for s in SIGNALS:
        signal.signal(s, lambda *_: stop.__setitem__("now", True))
    return stop


def stop_requested(local: bool, stop_file: str | None) -> bool:
    """True on every rank when any rank was signalled or the launching process wrote the stop file (one
    all-reduce of a scalar per step, so all ranks save the same step)."""
    flag = bool(local) or bool(stop_file and os.path.exists(stop_file))
    if dist.is_initialized() and dist.get_world_size() > 1:
        backend = dist.get_backend()
        t = torch.tensor([1.0 if flag else 0.0],
                         device=f"cuda:{torch.cuda.current_device()}" if backend == "nccl" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        flag = bool(t.item())
    return flag
