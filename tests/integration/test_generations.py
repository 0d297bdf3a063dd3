"""`main` on the embedded default store: MLproject entry points as nested runs, finished steps reused."""

import json
import os
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from mlflow import MlflowClient

from draftline.cli import cli

from ..conftest import DEMO

# benchmark tier: prepare -> finetune -> export twice through `main` (2 min), beyond CI's 50-minute budget; the
# stages it chains run in CI one by one (test_chain.py, test_kimi.py)
pytestmark = [pytest.mark.integration, pytest.mark.benchmark]


def invoke(*args):
    r = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_main_chains_entry_points_and_reuses_finished_steps(workspace, tiny, monkeypatch):
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")  # `python`
    args = ["main", "--conversations", DEMO, "--verifier", tiny["verifier"], "--init", "tiny",
            "--registered-model", "gen", "--set", "prepare.max_samples=120", "--set", "prepare.max_length=256",
            "--set", "finetune.gpus=1", "--set", "finetune.steps=3", "--set", "finetune.tokens_per_batch=512",
            "--set", "finetune.save_every=3"]
    first = invoke(*args)
    assert first["model_version"] == "models:/gen/1"
    client = MlflowClient()
    main_run = client.search_runs([client.get_run(first["prepare_run_id"]).info.experiment_id],
                                  "tags.`draftline.step` = 'main'")[0]
    for key in ("prepare_run_id", "finetune_run_id", "export_run_id"):
        child = client.get_run(first[key])
        assert child.data.tags["mlflow.parentRunId"] == main_run.info.run_id
        assert child.data.tags["mlflow.project.entryPoint"] == key.split("_")[0]

    second = invoke(*args)  # same parameters and commit: prepare and finetune are reused, export registers v2
    assert second["prepare_run_id"] == first["prepare_run_id"]
    assert second["finetune_run_id"] == first["finetune_run_id"]
    assert second["model_version"] == "models:/gen/2"
