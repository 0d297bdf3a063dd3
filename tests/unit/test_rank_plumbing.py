"""What the launching process does with the ranks' output, metrics and shards, without starting a rank."""

import io
import json

import pytest
from click.testing import CliRunner
from mlflow.entities import Metric

from draftline.cli import cli
from draftline.data.shards import open_prepared
from draftline.data.verify import ShardVerifier
from draftline.errors import DataError
from draftline.train.metrics_relay import MetricsFile, Relay
from draftline.train.rank_output import RankOutput


def test_rank_tracebacks_go_to_the_log_not_to_the_terminal(tmp_path):
    shown = io.StringIO()
    out = RankOutput(tmp_path / "ranks.log", stream=shown, verbose=False)
    lines = ["[draftline] plan: ZeRO-2 fits\n", "[rank1]: Traceback (most recent call last):\n",
             '[rank1]:   File "worker.py", line 3, in train\n', "[rank1]:     load()\n",
             "[rank1]: draftline.errors.CheckpointError: parent does not fit\n", "Traceback (most recent call last):\n",
             '  File "x.py", line 1\n', "ValueError: boom\n", "step 3 done\n"]
    for line in lines:
        out.write(line)
    out.close()
    assert shown.getvalue() == "[draftline] plan: ZeRO-2 fits\nstep 3 done\n"
    assert (tmp_path / "ranks.log").read_text() == "".join(lines)


def test_the_relay_delivers_what_rank_0_wrote_once_and_resumes_where_it_stopped(workspace):
    import mlflow

    with mlflow.start_run() as run:
        pass
    path = workspace / "metrics.jsonl"
    sink = MetricsFile(path)
    for step in (1, 2):
        sink.log_batch(run.info.run_id, metrics=[Metric("train/loss", 1.0 / step, 0, step)])
    relay = Relay(path, run.info.run_id)
    assert relay.deliver_once() and relay.delivered == 2
    sink.log_batch(run.info.run_id, metrics=[Metric("train/loss", 0.25, 0, 3)])
    with open(path, "a") as f:
        f.write('{"step": 4, "timest')  # a line rank 0 is still writing waits for its end
    again = Relay(path, run.info.run_id)  # a later process (a resume) continues from the mark
    assert again.close(wait_s=0) and again.delivered == 1
    steps = [m.step for m in mlflow.MlflowClient().get_metric_history(run.info.run_id, "train/loss")]
    assert sorted(steps) == [1, 2, 3]


def test_a_changed_shard_is_found_by_the_rank_that_checks_it_and_by_verify_data(prepared, tmp_path):
    import shutil

    data = shutil.copytree(prepared, tmp_path / "data")
    shards = sorted(data.glob("shard-*.safetensors"))
    raw = bytearray(shards[1].read_bytes())
    raw[-1] ^= 1
    shards[1].write_bytes(bytes(raw))
    opened = open_prepared(data)
    other = ShardVerifier(opened, rank=0, world_size=2).start()
    other.finish()  # shard 1 is rank 1's to check
    mine = ShardVerifier(opened, rank=1, world_size=2).start()
    with pytest.raises(DataError, match=f"shard {shards[1].name} in {data} does not match the sha256"):
        mine.finish()
    r = CliRunner().invoke(cli, ["verify-data", str(data)])
    assert r.exit_code == 1 and f"shard {shards[1].name}" in r.output
    ok = CliRunner().invoke(cli, ["verify-data", str(prepared)])
    assert ok.exit_code == 0 and json.loads(ok.output)["shards"] == len(shards)
