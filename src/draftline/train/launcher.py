"""Start the ranks of a finetune through DeepSpeed's own launcher.

``python -m deepspeed.launcher.runner --num_gpus N [--hostfile H] --master_port P --no_local_rank --module
draftline.train.worker --spec SPEC``. Without a GPU the ranks run on the CPU (``DS_ACCELERATOR=cpu``, gloo);
the rank count is always passed explicitly (the launcher counts one CPU "device" otherwise).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from draftline import errors
from draftline.errors import DraftlineError, Interrupted, TrainingError
from draftline.train.metrics_relay import Relay
from draftline.train.nodes import QUIET_C10D, Place
from draftline.train.progress import Progress
from draftline.train.rank_output import RankOutput
from draftline.train.rendezvous import Rendezvous
from draftline.train.signals import Stopper, resume_hint
from draftline.train.spec import WorkerSpec
from draftline.util import free_port


def gpu_count() -> int:
    try:
        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001
        return 0


def gpu_memory_gib() -> float | None:
    """The smallest GPU's memory on this node from ``nvidia-smi`` (no CUDA context is created), or None."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return min(float(x) for x in out.split()) / 1024 if out.split() else None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def hostfile_shape(path: str) -> tuple[int, int]:
    """``(gpus_per_node, nodes)`` from a DeepSpeed hostfile (``host slots=N`` lines; the smallest slots)."""
    hosts = [ln.split() for ln in Path(path).read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    slots = [int(w.split("=", 1)[1]) for h in hosts for w in h[1:] if w.startswith("slots=")]
    return (min(slots) if slots else 1), max(len(hosts), 1)


def resolve_ranks(gpus: int) -> tuple[int, bool]:
    """``(ranks, on_cpu)``: gpus=0 means every GPU, or one CPU rank where there is none."""
    available = gpu_count()
    if available == 0:
        return max(gpus, 1), True
    if gpus > available:
        raise TrainingError(f"gpus={gpus} but this node has {available} GPU(s); pass gpus<={available} "
                            "or a hostfile for more nodes")
    return gpus or available, False


def command(spec_path: Path, ranks: int, hostfile: str | None, port: int, place: Place | None = None) -> list[str]:
    """DeepSpeed's runner for every node from here (``hostfile``: pdsh/ssh), for this node alone in a per-node
    job (``place``: ``--no_ssh --node_rank``, a hostfile of the job's nodes), or for this machine."""
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner"]
    if place is not None and place.multi:
        nodes = spec_path.with_name("nodes.hostfile")  # the runner counts the job's ranks from it; no ssh
        nodes.write_text("".join(f"node{i} slots={ranks}\n" for i in range(place.nnodes)))
        cmd += ["--hostfile", str(nodes), "--no_ssh", "--node_rank", str(place.node_rank),
                "--master_addr", place.master_addr]
    elif hostfile:
        if not Path(hostfile).is_file():
            raise TrainingError(f"hostfile {hostfile} does not exist")
        cmd += ["--hostfile", hostfile]
    else:
        cmd += ["--num_gpus", str(ranks)]
    cmd += ["--master_port", str(port), "--no_local_rank", "--module", "draftline.train.worker",
            "--spec", str(spec_path)]
    return cmd


# Credentials stay with the launching process (the only one that talks to MLflow): DeepSpeed's multi-node
# launcher would otherwise put every MLFLOW* variable on the pdsh/ssh command line of every node.
CREDENTIALS = ("MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_USERNAME",
               "MLFLOW_TRACKING_CLIENT_CERT_PATH", "MLFLOW_TRACKING_SERVER_CERT_PATH")


def rank_env(ranks: int, on_cpu: bool) -> dict[str, str]:
    """The environment DeepSpeed's launcher and the ranks get: ours, without tracking credentials."""
    env = {k: v for k, v in os.environ.items() if k not in CREDENTIALS}
    if env.get(QUIET_C10D[0]) == QUIET_C10D[1]:
        del env[QUIET_C10D[0]]
    if on_cpu:
        env["DS_ACCELERATOR"] = "cpu"
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // ranks)))
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


@dataclass(frozen=True)
class Node:
    """This node's place in a per-node job and its end of the launchers' rendezvous."""

    place: Place
    rdv: Rendezvous


def launch(spec: WorkerSpec, spec_path: Path, *, ranks: int, on_cpu: bool, hostfile: str | None = None,
           node: Node | None = None) -> None:
    """Run the ranks to completion; a failing rank's message is raised here (a DraftlineError stays one).

    DeepSpeed's launcher runs in its own session: SIGTERM/SIGINT reach this process, which asks the ranks to
    save and stop (:mod:`draftline.train.signals`) and raises :class:`Interrupted` with the resume command.
    Rank output goes to ``ranks.log`` beside the spec, stderr shows draftline's own lines
    (:mod:`draftline.train.rank_output`); rank 0's metrics reach MLflow through :mod:`metrics_relay`, and the
    progress line (:mod:`draftline.train.progress`) from the same lines. In a per-node job (``node``) this
    node's launcher also watches the others (:mod:`draftline.train.rendezvous`): one failing stops all.
    """
    spec.write(spec_path)
    error_file = Path(spec.error_file)
    error_file.unlink(missing_ok=True)
    log = spec_path.with_name("ranks.log")
    progress = Progress(spec.config.steps) if spec.metrics_file else None
    out = RankOutput(log, stream=progress)
    relay = Relay(spec.metrics_file, spec.run_id, on_line=progress.update if progress else None) \
        if spec.metrics_file and spec.run_id else contextlib.nullcontext()
    place = node.place if node else None
    port = place.master_port if place and place.multi else free_port()
    # rank output is streamed to stderr: stdout carries only the command's result
    with relay, subprocess.Popen(command(spec_path, ranks, hostfile, port, place), env=rank_env(ranks, on_cpu),
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                                 start_new_session=True) as proc, \
            Stopper(proc, Path(spec.stop_file or spec_path.with_name("stop")),
                    on_signal=node.rdv.stopped if node else None) as stopper, \
            (node.rdv.watch(stopper.terminate) if node else contextlib.nullcontext()) as watch:
        for line in proc.stdout or ():
            out.write(line)
        proc.wait()
    out.close()
    if progress:
        progress.close()
    stopped = (signal.Signals(stopper.signum).name, "") if stopper.signum is not None else None
    if node and stopped is None and proc.returncode == 0:
        by = node.rdv.stopped_by()
        stopped = (by[1], f" on node {by[0]}") if by else None
    if stopped:
        latest = Path(spec.checkpoint_dir) / "latest"
        saved = f"checkpoint {latest.read_text().strip()} saved in {latest.parent}" if latest.is_file() else \
            "no checkpoint was saved yet"
        where = " on every node" if node else ""
        raise Interrupted(f"finetune stopped by {stopped[0]}{stopped[1]} ({saved}); resume it{where} with: "
                          f"{resume_hint(spec.run_id, per_node=bool(node))}" + (_OWN_RANK if node else ""),
                          getattr(signal, stopped[0], signal.SIGTERM))
    reason = getattr(watch, "reason", None)
    if proc.returncode == 0 and reason is None:
        if node:
            node.rdv.done()
        return
    err = _failure(proc.returncode, error_file, log)
    if node is None:
        raise err
    user_error = not isinstance(err, TrainingError)
    node.rdv.fail(str(err), draftline=user_error)
    cause = reason or node.rdv.cause(str(err))
    if user_error and cause == str(err):
        raise err
    raise TrainingError(f"{cause}; the ranks of every node stopped with it. The run ended; resume it on every "
                        f"node with: {resume_hint(spec.run_id, per_node=True)}{_OWN_RANK}")


_OWN_RANK = " (each node with its own --node-rank, or the cluster's variables)"


def _failure(returncode: int, error_file: Path, log: Path) -> DraftlineError:
    """What the ranks' failure says: a rank's DraftlineError as itself, any other as a TrainingError."""
    if error_file.is_file():
        err = json.loads(error_file.read_text())
        if err.get("draftline"):
            cls = getattr(errors, err["type"], DraftlineError)
            return cls(err["message"])
        return TrainingError(f"a training rank failed:\n{err['message']}\n(all rank output: {log})")
    return TrainingError(f"the DeepSpeed launcher exited with {returncode}; all rank output is in {log} "
                         "(-vv or DRAFTLINE_LOG=debug shows it here)")
