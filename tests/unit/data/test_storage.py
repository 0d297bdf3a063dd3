"""What prepared data costs on disk, said before it is written, and a disk that is too small or fills up: refused
before the run starts, or stopped between shards with the finished ones kept and resumed from them. The small
disks are real file systems (loop-mounted ext4 images): the kernel itself refuses the write."""

import json

import pytest
import torch
from click.testing import CliRunner
from mlflow import MlflowClient

from draftline.cli import cli
from draftline.config import PrepareConfig
from draftline.data import prepare, storage
from draftline.data.inputs import read_inputs
from draftline.data.shards import PROGRESS, ShardWriter, open_prepared
from draftline.errors import DiskFullError

from ...conftest import DEMO

MB = 1 << 20


def _flags(tiny, out):
    return ["--conversations", str(DEMO), "--verifier", str(tiny["verifier"]), "--max-length", "256",
            "--shard-tokens", "4096", "--output-dir", str(out)]


def _runs():
    client = MlflowClient()
    return client.search_runs([e.experiment_id for e in client.search_experiments()])


def test_the_kimi_k25_token_costs_what_the_mission_plans():
    assert storage.token_bytes(7168, 3) == 57_353  # (3 aux + last) x 7168 x 2 bytes + id + mask
    plan = storage.shard_bytes(7168, 3, tokens=25_000 * 3_000, samples=25_000, tokens_source="assumed")
    assert 4.30e12 < plan.bytes < 4.31e12 and plan.needed > plan.bytes


def test_the_estimate_is_what_prepare_writes(tiny, prepared):
    """The tokens counted from the text before any capture, against the shards a prepare of the same inputs
    wrote: within 10% (a chat template's markers are an allowance), and exact per token."""
    cfg = PrepareConfig(conversations=str(DEMO), verifier=str(tiny["verifier"]), max_length=256)
    plan = prepare.preflight(cfg, read_inputs(cfg))
    data = open_prepared(prepared)
    written = sum((prepared / e["file"]).stat().st_size for e in data.manifest["shards"])
    assert abs(plan.tokens / data.manifest["tokens"] - 1) < 0.10, (plan.tokens, data.manifest["tokens"])
    assert abs(data.manifest["tokens"] * plan.bytes_per_token / written - 1) < 0.001  # headers: a few hundred bytes


def test_regeneration_counts_every_answer_at_its_most(tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny["verifier"])
    samples = [{"messages": [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "a " * 50},
                             {"role": "user", "content": "and?"}]}]
    plain = storage.estimate_tokens(samples, tok, 10_000)
    regen = storage.estimate_tokens(samples, tok, 10_000, regenerate_max_tokens=500)
    assert regen >= 2 * 500 and plain < 200  # the assistant turn and the trailing user turn's answer
    assert storage.estimate_tokens(samples, tok, 64, regenerate_max_tokens=500) == 64  # cut at max_length


def test_a_disk_too_small_is_refused_before_the_run_starts(workspace, tiny, small_disk):
    disk = small_disk(2 * MB)
    r = CliRunner().invoke(cli, ["prepare", *_flags(tiny, disk / "data")], catch_exceptions=False)
    assert r.exit_code == 1, r.output
    errors = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in r.output
    assert "prepare's shards" in errors[0] and f"the file system of {disk / 'data'} has" in errors[0]
    assert "--disk-check false" in errors[0] and "--output-dir" in errors[0]
    assert _runs() == [] and not (disk / "data").exists()


def test_a_disk_that_fills_mid_capture_stops_cleanly_and_the_rerun_resumes(workspace, tiny, prepared, small_disk,
                                                                           caplog):
    """With the checks off, the kernel refuses a shard half-way: one line, exit 1, the run FAILED, the finished
    shards kept and no partial one; the disk grown, the same command resumes in the same run and writes what an
    uninterrupted prepare wrote."""
    from tests.kit.smallfs import resize

    total = sum((prepared / e["file"]).stat().st_size for e in open_prepared(prepared).manifest["shards"])
    disk = small_disk(total // 2)
    flags = [*_flags(tiny, disk / "data"), "--disk-check", "false"]
    r = CliRunner().invoke(cli, ["prepare", *flags], catch_exceptions=False)
    assert r.exit_code == 1, r.output
    errors = [line for line in r.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "no space left on device" in errors[0], r.output
    kept = len(json.loads((disk / "data" / PROGRESS).read_text())["shards"])
    assert kept >= 1 and f"{kept} finished shards are kept" in errors[0] and "resumes after them" in errors[0]
    assert not list((disk / "data").glob("*.tmp"))
    (failed,) = _runs()
    assert failed.info.status == "FAILED"

    resize(disk, 4 * total)
    done = CliRunner().invoke(cli, ["prepare", *flags], catch_exceptions=False)
    assert done.exit_code == 0, done.output
    result = json.loads(done.stdout)
    assert result["run_id"] == failed.info.run_id and f"after {kept} finished shards" in caplog.text
    assert result["digest"] == open_prepared(prepared).manifest["digest"]


def test_a_shard_that_no_longer_fits_stops_before_it_is_written(small_disk):
    disk = small_disk(1 * MB)
    writer = ShardWriter(disk / "data", "k", shard_tokens=16, vocab_size=8)
    n = 600  # 600 tokens x 1024 bf16 values: 1.2 MB of hidden states
    writer.add({"input_ids": torch.zeros(n, dtype=torch.long), "loss_mask": torch.ones(n, dtype=torch.bool),
                "hidden_states": torch.zeros(n, 768, dtype=torch.bfloat16),
                "verifier_last_hidden_states": torch.zeros(n, 256, dtype=torch.bfloat16)})
    with pytest.raises(DiskFullError, match=r"the next shard \(shard-00000.safetensors\) needs .* free: 0 finished "
                                            r"shards are kept"):
        writer.boundary()
    assert list((disk / "data").iterdir()) == []
