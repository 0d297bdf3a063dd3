"""A finetune run as one job of several nodes, each started by the cluster (one Slurm task or Kubernetes pod per
node) with the same command: node 0 opens the one MLflow run and resolves everything once; every other node
attaches to it, trains its ranks from node 0's spec and logs nothing of its own.

Every node must see the same paths: the work directory (``DRAFTLINE_WORK``: the spec, the vocabulary and the
checkpoints), the prepared data, the verifier and the parent, on storage every node mounts, as DeepSpeed's
checkpoints already require. A follower checks that before its ranks start.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator
from pathlib import Path

from draftline.config import FinetuneConfig, FinetuneNode, work_dir
from draftline.console import say
from draftline.data.inputs import read_manifest
from draftline.errors import DataError, DraftlineError, Interrupted
from draftline.results import NodeResult
from draftline.train.launcher import Node, launch
from draftline.train.nodes import Place
from draftline.train.rendezvous import Rendezvous
from draftline.train.spec import WorkerSpec

NONCE = ".rendezvous"  # node 0 writes one per job start into the checkpoint folder; every node must read it
PLACE_FIELDS = set(FinetuneNode.model_fields)  # this node's place: each node sets it for itself


def settings_of(cfg: FinetuneConfig, place: Place, resume_run: str | None, ranks: int) -> dict:
    """What every node of a job must agree on: the settings (not this node's place), the run resumed, the ranks
    per node and the job's shape."""
    return {**cfg.model_dump(mode="json", exclude=PLACE_FIELDS), "resume": resume_run, "ranks_per_node": ranks,
            "nnodes": place.nnodes, "master": f"{place.master_addr}:{place.master_port}"}


class Leader:
    """Node 0's side: gather the nodes before the run exists, hand them the spec, keep the store until all end."""

    def __init__(self, place: Place, timeout_s: float):
        self.place = place
        self.rdv = Rendezvous(place, timeout_s)
        self.node = Node(place, self.rdv)
        self.started = False

    def gather(self, settings: dict) -> None:
        say(f"{self.place.describe()}: waiting for the other {self.place.nnodes - 1} node(s)")
        self.rdv.gather(settings)

    @contextlib.contextmanager
    def telling(self) -> Iterator[None]:
        """A mistake found on node 0 before the ranks start is every node's: each prints it and exits."""
        try:
            yield
        except Interrupted:
            self.rdv.tell("node 0 was stopped before training started", DataError)
            raise
        except DraftlineError as e:
            self.rdv.tell(f"node 0: {e}", type(e))
            raise

    def go(self, spec: WorkerSpec, *, data_digest: str, eval_digest: str | None) -> None:
        """Hand every node the spec; wait until each has seen the spec's files."""
        nonce = secrets.token_hex(8)
        (Path(spec.checkpoint_dir) / NONCE).write_text(nonce)
        self.rdv.go({"spec": spec.model_dump(mode="json"), "nonce": nonce, "data_digest": data_digest,
                     "eval_digest": eval_digest})
        self.started = True
        self.rdv.wait_ready()
        say(f"all {self.place.nnodes} nodes joined run {spec.run_id}")

    def close(self) -> None:
        if self.started:  # the store stays up until every node's ranks ended
            self.rdv.wait_done()
        else:  # ... or until every node read why the job did not start
            self.rdv.wait_read()
        self.rdv.close()


def unreadable(spec: WorkerSpec, go: dict) -> str | None:
    """What this node cannot see of node 0's spec, in one phrase (None: everything)."""
    fix = ("every node must see the work directory (DRAFTLINE_WORK), the prepared data, the verifier and the "
           "parent at the same paths: put them on storage every node mounts")
    for what, path, digest in (("the prepared data", spec.data_dir, go["data_digest"]),
                               ("the evaluation set", spec.eval_data_dir, go["eval_digest"])):
        if path is None:
            continue
        try:
            seen = read_manifest(Path(path)).get("digest")
        except (DraftlineError, OSError):
            return f"cannot read {what} at {path}, where node 0 found it: {fix}"
        if seen != digest:
            return f"{what} at {path} is not node 0's (digest {str(seen)[:12]}, node 0 {digest[:12]}): {fix}"
    for what, path in (("the verifier", spec.verifier), ("the parent", spec.parent_path),
                       ("the draft vocabulary", spec.vocab_file)):
        if path and not Path(path).exists():
            return f"cannot see {what} at {path}: {fix}"
    nonce = Path(spec.checkpoint_dir) / NONCE
    if not nonce.is_file() or nonce.read_text().strip() != go["nonce"]:
        return f"the checkpoint folder {spec.checkpoint_dir} here is not node 0's: {fix}"
    return None


def follow(cfg: FinetuneConfig, place: Place, *, resume_run: str | None, ranks: int, on_cpu: bool) -> NodeResult:
    """A node other than 0: join node 0's run, check its files, train this node's ranks, log nothing."""
    rdv = Rendezvous(place, cfg.rendezvous_timeout)
    try:
        say(f"{place.describe()}: joining node 0")
        go = rdv.join(settings_of(cfg, place, resume_run, ranks))
        spec = WorkerSpec.model_validate(go["spec"])
        problem = unreadable(spec, go)
        rdv.ready(problem)
        if problem:
            raise DataError(f"node {place.node_rank}: {problem}")
        work = work_dir() / (spec.run_id or "no-run") / f"node{place.node_rank}"
        work.mkdir(parents=True, exist_ok=True)
        spec = spec.model_copy(update={"error_file": str(work / "rank_error.json"), "stop_file": str(work / "stop"),
                                       "metrics_file": None, "load_report": str(work / "parent_load_report.json")})
        say(f"node {place.node_rank}: training {ranks} rank(s) in run {spec.run_id} (node 0 logs it)")
        launch(spec, work / "worker_spec.json", ranks=ranks, on_cpu=on_cpu, node=Node(place, rdv))
    finally:
        rdv.close()
    say(f"node {place.node_rank}: its ranks finished; node 0 logs run {spec.run_id}")
    return NodeResult(run_id=spec.run_id, node_rank=str(place.node_rank))
