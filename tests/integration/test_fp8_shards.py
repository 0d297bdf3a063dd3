"""A data set stored in fp8 (prepare --hidden-storage fp8) through the pipeline: recorded as such, half the
bytes, and finetune and evaluate read it as bf16."""

import json

import pytest
from click.testing import CliRunner
from mlflow import MlflowClient

from draftline import names
from draftline.cli import cli
from draftline.data.refs import resolve_data
from draftline.data.shards import open_prepared

from ..conftest import DEMO

pytestmark = pytest.mark.integration  # a prepare, a one-rank finetune and an evaluation: under a minute


def invoke(*args):
    r = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_a_finetune_on_fp8_shards(workspace, tiny, prepared):
    prep = invoke("prepare", "--conversations", DEMO, "--verifier", tiny["verifier"], "--max-length", "256",
                  "--shard-tokens", "4096", "--hidden-storage", "fp8")
    client = MlflowClient()
    assert client.get_run(prep["run_id"]).data.params[names.DATA_HIDDEN_STORAGE] == "fp8"
    data = open_prepared(resolve_data(prep["data_uri"]))
    bf16 = open_prepared(prepared)
    assert data.manifest["hidden_storage"] == "fp8" and data.manifest["tokens"] == bf16.manifest["tokens"]
    assert data.manifest["bytes_per_token"] < 0.55 * bf16.manifest["bytes_per_token"]
    ft = invoke("finetune", "--data", prep["data_uri"], "--init", "tiny", "--gpus", "1", "--steps", "3",
                "--tokens-per-batch", "512", "--val-fraction", "0.1", "--val-every", "3")
    metrics = client.get_run(ft["run_id"]).data.metrics
    assert metrics[names.TRAIN_LOSS] > 0 and 1.0 <= metrics[names.VAL_ACCEPTANCE_LENGTH] <= 4.0
    ev = invoke("evaluate", "--target", f"runs:/{ft['run_id']}", "--data", prep["data_uri"], "--no-measured",
                "--max-prompts", "8")
    assert 1.0 <= ev["teacher_forced_acceptance_length"] <= 4.0
