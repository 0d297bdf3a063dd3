"""This node's place in a multi-node finetune, from the flags or from what the cluster sets.

A cluster starts one finetune per node (Slurm: one ``srun`` task per node; Kubernetes: one pod per node, as a
PyTorchJob or JobSet does); each runs DeepSpeed's own launcher for its node only (``--no_ssh --node_rank``).
Flags win; otherwise the first variable set in each row of :data:`SOURCES` is read, so the same command line
serves every node. Standard library only: the CLI checks the place before torch loads.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from draftline.errors import UsageError

# the launching process of a per-node job silences c10d's C++ logging (set before torch loads); ranks keep theirs
QUIET_C10D = ("TORCH_CPP_LOG_LEVEL", "FATAL")
DEFAULT_PORT = 29500  # torch.distributed's and DeepSpeed's default master port

# (field, variables in the order they are read): torchrun/PyTorchJob elastic (PET_*), Slurm, plain env://
SOURCES: dict[str, tuple[str, ...]] = {
    "nnodes": ("NNODES", "PET_NNODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"),
    "node_rank": ("NODE_RANK", "PET_NODE_RANK", "SLURM_NODEID", "GROUP_RANK"),
    "master_addr": ("MASTER_ADDR", "PET_MASTER_ADDR"),
    "master_port": ("MASTER_PORT", "PET_MASTER_PORT"),
}
# Kubeflow's PyTorchJob without nprocPerNode starts one process per pod with WORLD_SIZE = pods and RANK = the
# pod's index: read as nnodes / node_rank only together, only where the rows above name nothing, and never where
# a per-process launcher (torchrun, a PyTorchJob with nprocPerNode) has set LOCAL_* beside them: there WORLD_SIZE
# counts processes, not nodes.
POD_PAIR = ("WORLD_SIZE", "RANK")
PER_PROCESS = ("LOCAL_RANK", "LOCAL_WORLD_SIZE")


@dataclass(frozen=True)
class Place:
    """Where this node stands: ``nnodes`` nodes, this one ``node_rank``; ``source`` says where each came from."""

    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    source: dict[str, str]

    @property
    def multi(self) -> bool:
        return self.nnodes > 1

    @property
    def leader(self) -> bool:
        return self.node_rank == 0

    @property
    def store_port(self) -> int:
        """The launchers' own rendezvous (train.rendezvous): the port after the ranks' master port."""
        return self.master_port + 1

    def describe(self) -> str:
        where = ", ".join(f"{k} from {v}" for k, v in self.source.items() if not v.startswith("--"))
        return (f"node {self.node_rank} of {self.nnodes}, master {self.master_addr}:{self.master_port}"
                + (f" ({where})" if where else ""))


def _int(name: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise UsageError(f"{name}={text!r} is not a whole number: set it to this node's "
                         f"{'index' if 'RANK' in name or 'NODEID' in name else 'count'}") from None


def _read(given: dict[str, Any], env: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    """Each field from its flag, else from the first variable of its row in :data:`SOURCES` that is set."""
    values: dict[str, Any] = {}
    source: dict[str, str] = {}
    for field, names in SOURCES.items():
        if given[field] is not None:
            values[field], source[field] = given[field], "--" + field.replace("_", "-")
            continue
        name = next((n for n in names if env.get(n, "").strip()), None)
        if name:
            raw = env[name].strip()
            values[field] = raw if field == "master_addr" else _int(name, raw)
            source[field] = name
    if ("nnodes" not in values and "node_rank" not in values and all(env.get(n, "").strip() for n in POD_PAIR)
            and not any(env.get(n, "").strip() for n in PER_PROCESS)):
        for field, name in zip(("nnodes", "node_rank"), POD_PAIR):
            values[field], source[field] = _int(name, env[name].strip()), name
    return values, source


def place(*, nnodes: int | None, node_rank: int | None, master_addr: str | None, master_port: int | None,
          hostfile: str | None = None, env: Mapping[str, str] | None = None) -> Place:
    """This node's :class:`Place`; one :class:`UsageError` naming the setting for a rank outside the job, a
    missing master address or a hostfile given beside per-node launch."""
    env = os.environ if env is None else env
    if hostfile and nnodes is None and node_rank is None:
        # the pdsh path launches every node from this one: what a Slurm allocation sets around it is not a place
        env = {}
    given = {"nnodes": nnodes, "node_rank": node_rank, "master_addr": master_addr, "master_port": master_port}
    values, source = _read(given, env)
    n = int(values.get("nnodes", 1))
    rank = int(values.get("node_rank", 0))
    if n < 1:
        raise UsageError(f"nnodes={n} ({source.get('nnodes', '--nnodes')}): a job has at least one node")
    if not 0 <= rank < n:
        raise UsageError(f"node rank {rank} ({source.get('node_rank', 'default')}) is outside a job of {n} nodes "
                         f"({source.get('nnodes', 'no --nnodes given')}): pass --node-rank 0..{n - 1}, or --nnodes "
                         "with the job's size")
    if n == 1:
        return Place(1, 0, "127.0.0.1", int(values.get("master_port", DEFAULT_PORT)), {})
    if hostfile:
        raise UsageError(f"--hostfile launches every node from this one over pdsh/ssh; --nnodes {n} "
                         f"({source['nnodes']}) runs one finetune per node: pass one or the other")
    if "master_addr" not in values:
        raise UsageError(f"a job of {n} nodes needs node 0's address: pass --master-addr HOST or set MASTER_ADDR "
                         "(the same on every node)")
    port = int(values.get("master_port", DEFAULT_PORT))
    if not 1024 <= port < 65535:
        raise UsageError(f"master port {port}: pass --master-port 1024..65534 (the launchers also use the next one)")
    return Place(n, rank, str(values["master_addr"]), port, source)
