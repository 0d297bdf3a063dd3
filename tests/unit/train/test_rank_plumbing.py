"""What the launching process does with the ranks' output, metrics and shards, without starting a rank."""

import io
import json

import pytest
from click.testing import CliRunner
from mlflow.entities import Metric

from draftline import names
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
        sink.log_batch(run.info.run_id, metrics=[Metric(names.TRAIN_LOSS, 1.0 / step, 0, step)])
    relay = Relay(path, run.info.run_id)
    assert relay.deliver_once() and relay.delivered == 2
    sink.log_batch(run.info.run_id, metrics=[Metric(names.TRAIN_LOSS, 0.25, 0, 3)])
    with open(path, "a") as f:
        f.write('{"step": 4, "timest')  # a line rank 0 is still writing waits for its end
    again = Relay(path, run.info.run_id)  # a later process (a resume) continues from the mark
    assert again.close(wait_s=0) and again.delivered == 1
    steps = [m.step for m in mlflow.MlflowClient().get_metric_history(run.info.run_id, names.TRAIN_LOSS)]
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


def test_at_the_default_verbosity_only_draftlines_own_rank_lines_reach_the_terminal(tmp_path):
    shown = io.StringIO()
    out = RankOutput(tmp_path / "ranks.log", stream=shown, level="warning")
    lines = ["[2026-01-01] [INFO] [launch.py:152:main] WORLD INFO DICT: {'localhost': [0, 1]}\n",
             "[rank0]: [draftline] resumed from /w/checkpoints at step 4\n", "Processing zero checkpoint\n"]
    for line in lines:
        out.write(line)
    out.close()
    assert shown.getvalue() == "[draftline] resumed from /w/checkpoints at step 4\n"
    assert (tmp_path / "ranks.log").read_text() == "".join(lines)


def _record(step, **metrics):
    return {"step": step, "timestamp": 0, "metrics": metrics}


def test_the_progress_line_off_a_terminal_is_a_plain_line_at_the_start_every_n_seconds_and_at_the_end():
    from draftline.train.progress import Progress

    now = [0.0]
    shown = io.StringIO()
    p = Progress(40, shown, tty=False, every_s=10, clock=lambda: now[0])
    p.update(_record(0, **{names.VAL_ACCEPTANCE_LENGTH: 1.05}))
    for step in range(1, 41):
        now[0] = step * 1.0
        p.update(_record(step, **{names.TRAIN_LOSS: 5.0, names.TRAIN_FULL_ACC_0: 0.25, names.TRAIN_ACCEPTANCE_LENGTH: 1.3,
                                  names.TRAIN_TOKENS_PER_S: 800.0}))
    p.close()
    lines = shown.getvalue().splitlines()
    assert [ln.split()[2] for ln in lines] == ["1/40", "11/40", "21/40", "31/40", "40/40"]
    assert lines[1] == ("[draftline] step 11/40  loss 5.000  full_acc_0 0.250  acceptance 1.30 (val 1.05)  "
                        "800 tok/s  ETA 0:29")
    assert lines[-1].endswith("done in 0:39")


def test_the_progress_line_on_a_terminal_is_redrawn_in_place_with_other_output_above_it():
    from draftline.train.progress import Progress

    shown = io.StringIO()
    p = Progress(2, shown, tty=True)
    p.update(_record(1, **{names.TRAIN_LOSS: 5.0}))
    p.write("[draftline] something happened\n")
    p.update(_record(2, **{names.TRAIN_LOSS: 4.0}))
    p.close()
    text = shown.getvalue()
    assert text.count("\r\x1b[K") == 3 and text.endswith("step 2/2  loss 4.000  done in 0:00\n")
    assert "\r\x1b[K[draftline] something happened\n[draftline] step 1/2" in text
