"""This node's place in a per-node job, as Slurm, Kubernetes and the flags give it."""

import pytest

from draftline.errors import UsageError
from draftline.train.nodes import place


def _place(env, **flags):
    given = {"nnodes": None, "node_rank": None, "master_addr": None, "master_port": None, **flags}
    return place(**given, env=env)


def test_slurm_sets_the_place_of_each_task():
    p = _place({"SLURM_NNODES": "2", "SLURM_NODEID": "1", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29555"})
    assert (p.nnodes, p.node_rank, p.master_addr, p.master_port, p.store_port) == (2, 1, "10.0.0.5", 29555, 29556)
    assert "node_rank from SLURM_NODEID" in p.describe()


def test_a_pytorchjob_pod_is_a_node_by_its_world_size_and_rank():
    p = _place({"WORLD_SIZE": "4", "RANK": "3", "MASTER_ADDR": "drafter-master-0"})
    assert (p.nnodes, p.node_rank, p.master_port) == (4, 3, 29500)


def test_flags_win_over_the_environment():
    p = _place({"NNODES": "4", "NODE_RANK": "3", "MASTER_ADDR": "a"}, nnodes=2, node_rank=0, master_addr="b")
    assert (p.nnodes, p.node_rank, p.master_addr) == (2, 0, "b")


def test_one_node_needs_nothing():
    assert not _place({}).multi


@pytest.mark.parametrize(("env", "flags", "said"), [
    ({}, {"nnodes": 2, "node_rank": 2, "master_addr": "a"}, "outside a job of 2 nodes"),
    ({"SLURM_NNODES": "2", "SLURM_NODEID": "0"}, {}, "--master-addr HOST or set MASTER_ADDR"),
    ({"NODE_RANK": "one", "NNODES": "2"}, {}, "NODE_RANK='one' is not a whole number"),
])
def test_a_place_outside_the_job_is_refused_in_one_line(env, flags, said):
    with pytest.raises(UsageError, match=said):
        _place(env, **flags)


def test_a_hostfile_and_per_node_launch_are_one_or_the_other():
    with pytest.raises(UsageError, match="one or the other"):
        place(nnodes=2, node_rank=0, master_addr="a", master_port=None, hostfile="hosts", env={})


def test_a_node_rank_without_a_job_of_that_size_is_refused():
    with pytest.raises(UsageError, match="node rank 3 .* outside a job of 1 nodes"):
        _place({}, node_rank=3)


def test_the_hostfile_path_inside_a_slurm_allocation_is_not_a_per_node_job():
    """pdsh launches every node from this one: SLURM_NNODES around it says nothing about this process's place."""
    p = place(nnodes=None, node_rank=None, master_addr=None, master_port=None, hostfile="hosts",
              env={"SLURM_NNODES": "2", "SLURM_NODEID": "0", "MASTER_ADDR": "a"})
    assert not p.multi


def test_world_size_of_a_per_process_launcher_counts_processes_not_nodes():
    assert not _place({"WORLD_SIZE": "8", "RANK": "5", "LOCAL_RANK": "5", "LOCAL_WORLD_SIZE": "8",
                       "MASTER_ADDR": "a"}).multi


def _spec(tmp_path, data_dir):
    from draftline.config import FinetuneConfig
    from draftline.train.spec import WorkerSpec

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir(exist_ok=True)
    (ckpt / ".rendezvous").write_text("n0nce")
    vocab = tmp_path / "vocab.safetensors"
    vocab.write_text("")
    return WorkerSpec(config=FinetuneConfig(data=str(data_dir)), run_id="r", data_dir=str(data_dir),
                      verifier=str(tmp_path), aux_layer_ids=[1], layer={}, vocab_file=str(vocab), micro_batch_tokens=1,
                      ds_config={}, checkpoint_dir=str(ckpt), load_report="x", error_file="y")


def test_a_node_that_cannot_see_node_0s_shards_says_so_before_training(tmp_path):
    """What a follower checks before its ranks start: node 0's data at the same path, the same data set there,
    node 0's checkpoint folder."""
    import json

    from draftline.train.job import unreadable

    go = {"data_digest": "a" * 64, "eval_digest": None, "nonce": "n0nce"}
    missing = unreadable(_spec(tmp_path, tmp_path / "not-mounted-here"), go)
    assert missing.startswith(f"cannot read the prepared data at {tmp_path / 'not-mounted-here'}, where node 0")
    assert "storage every node mounts" in missing
    other = tmp_path / "data"
    other.mkdir()
    (other / "manifest.json").write_text(json.dumps({"digest": "b" * 64}))
    assert "is not node 0's (digest bbbbbbbbbbbb, node 0 aaaaaaaaaaaa)" in unreadable(_spec(tmp_path, other), go)
    (other / "manifest.json").write_text(json.dumps({"digest": "a" * 64}))
    assert unreadable(_spec(tmp_path, other), go) is None
    assert "checkpoint folder" in unreadable(_spec(tmp_path, other), {**go, "nonce": "another job's"})
