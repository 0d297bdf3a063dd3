"""The cluster launch snippets of docs/multi-gpu.md ("One finetune per node") kept true to the code: the Slurm
script and the Kubeflow PyTorchJob manifest run ``draftline finetune`` with options it declares and values its
settings accept, and the environment each Slurm task or pod would see gives every node its own place."""

import re
import shlex
from pathlib import Path

import pytest
import yaml

from draftline.cli import _settings, cli
from draftline.config import FinetuneConfig
from draftline.train.nodes import DEFAULT_PORT, place

DOC = Path(__file__).resolve().parents[3] / "docs" / "multi-gpu.md"
SECTION = "## One finetune per node (Slurm, Kubernetes)"
OPERATOR_PORT = 23456  # the training operator's port when the "pytorch" container names no "pytorchjob-port"


def _block(lang: str) -> str:
    text = DOC.read_text()
    assert SECTION in text, f"{DOC.name} has no section {SECTION!r}"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(rf"^```{lang}\n(.*?)^```", section, re.M | re.S)
    assert len(blocks) == 1, f"{SECTION!r} in {DOC.name} should show one ```{lang} block, shows {len(blocks)}"
    return blocks[0]


def _finetune_args(argv: list[str], where: str) -> list[str]:
    for i, word in enumerate(argv):
        if word == "finetune" and (argv[i - 1].endswith("draftline") or argv[max(i - 2, 0):i] == ["-m", "draftline.cli"]):
            return argv[i + 1:]
    pytest.fail(f"{where} runs no `draftline finetune`: {shlex.join(argv)}")


def _settings_of(args: list[str], where: str) -> FinetuneConfig:
    """The settings the snippet's finetune would run with; an option finetune does not declare fails by name."""
    command = cli.commands["finetune"]
    declared = {o for p in command.params for o in p.opts}
    unknown = [a.split("=", 1)[0] for a in args if a.startswith("-") and a.split("=", 1)[0] not in declared]
    assert not unknown, f"{where}: `draftline finetune` has no option {', '.join(unknown)}"
    params = dict(command.make_context("finetune", list(args), resilient_parsing=False).params)
    params.pop("resume_run")
    return _settings(FinetuneConfig, params.pop("config_file"), params)


def _place(cfg: FinetuneConfig, env: dict[str, str]):
    return place(nnodes=cfg.nnodes, node_rank=cfg.node_rank, master_addr=cfg.master_addr,
                 master_port=cfg.master_port, hostfile=cfg.hostfile, env=env)


def test_the_slurm_script_runs_one_finetune_per_node():
    script = _block("bash").splitlines()
    sbatch: dict[str, str] = {}
    for words in (shlex.split(line[len("#SBATCH"):]) for line in script if line.startswith("#SBATCH")):
        for i, word in enumerate(words):
            if word.startswith("-"):
                key, _, value = word.lstrip("-").partition("=")
                sbatch[key] = value or (words[i + 1] if i + 1 < len(words) else "")
    nodes = int(sbatch.get("nodes") or sbatch["N"])
    assert nodes > 1, "the Slurm example should span several nodes"
    assert sbatch.get("ntasks-per-node") == "1", "one task per node: DeepSpeed's launcher starts that node's ranks"
    hosts = [f"gpu{i:02d}" for i in range(nodes)]
    exports: dict[str, str] = {}
    for line in (line for line in script if line.startswith("export ")):
        for name, value in re.findall(r"(\w+)=(\$\([^)]*\)|\"[^\"]*\"|\S+)", line):
            if value.startswith("$(scontrol show hostnames") and re.search(r"head -n ?1\)$", value):
                value = hosts[0]  # the first host of the allocation: the one Slurm numbers node 0
            assert "$" not in value, f"the Slurm script exports {name}={value}: the test cannot stand in for it"
            exports[name] = value.strip('"')
    assert "DRAFTLINE_WORK" in exports, "every node needs the same (shared) work directory"
    srun = [line for line in script if line.startswith("srun ")]
    assert len(srun) == 1, "the Slurm script should start the finetune with one srun line"
    argv = shlex.split(re.sub(r"<[^<>]*>", "PLACEHOLDER", srun[0]))  # `<prepare run>`: the reader fills it in
    cfg = _settings_of(_finetune_args(argv, "the Slurm script"), "the Slurm script")
    for i in range(nodes):
        env = {**exports, "SLURM_NNODES": str(nodes), "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_NODEID": str(i),
               "SLURM_PROCID": str(i), "SLURM_JOB_NODELIST": f"gpu[00-{nodes - 1:02d}]"}
        p = _place(cfg, env)
        port = int(exports.get("MASTER_PORT", DEFAULT_PORT))
        assert (p.nnodes, p.node_rank, p.master_addr, p.master_port) == (nodes, i, hosts[0], port)


@pytest.mark.parametrize("pet", [False, True], ids=["classic operator", "operator with PET_ variables"])
def test_the_pytorchjob_runs_one_finetune_per_pod(pet):
    job = yaml.safe_load(_block("yaml"))
    kind = (job.get("apiVersion"), job.get("kind"))
    assert kind == ("kubeflow.org/v1", "PyTorchJob"), f"the manifest is {kind}: this test knows what a kubeflow.org/v1 PyTorchJob sets"
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Master", "Worker"} and specs["Master"]["replicas"] == 1, "one Master pod, then Workers"
    assert "elasticPolicy" not in job["spec"], "an elastic job sets PET_NNODES to a range, which is no node count"
    pods = [("Master", 0)] + [("Worker", j) for j in range(specs["Worker"]["replicas"])]
    master = f"{job['metadata']['name']}-master-0"
    for rank, (role, _) in enumerate(pods):
        containers = {c["name"]: c for c in specs[role]["template"]["spec"]["containers"]}
        assert "pytorch" in containers, f"{role}: the operator sets its variables in the container named pytorch"
        container = containers["pytorch"]
        where = f"the PyTorchJob's {role}"
        cfg = _settings_of(_finetune_args([*container["command"], *container.get("args", [])], where), where)
        env = {e["name"]: str(e["value"]) for e in container.get("env", []) if "value" in e}
        assert "DRAFTLINE_WORK" in env, f"{where}: every node needs the same (shared) work directory"
        port = next((p["containerPort"] for p in container.get("ports", []) if p.get("name") == "pytorchjob-port"),
                    OPERATOR_PORT)
        env |= {"MASTER_ADDR": master, "MASTER_PORT": str(port), "WORLD_SIZE": str(len(pods)), "RANK": str(rank),
                "PYTHONUNBUFFERED": "0"}
        if pet:  # newer training operators add torchrun's variables beside them
            env |= {"PET_NNODES": str(len(pods)), "PET_NODE_RANK": str(rank), "PET_NPROC_PER_NODE": "auto"}
        p = _place(cfg, env)
        assert (p.nnodes, p.node_rank, p.master_addr, p.master_port) == (len(pods), rank, master, port)
