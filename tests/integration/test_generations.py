"""`main` on the embedded default store (MLproject entry points as nested runs, finished steps reused), then a
second generation finetuned from the registered first one with ZeRO-3, 2 ranks and a rebuilt vocabulary."""

import json
import os
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from mlflow import MlflowClient

from draftline.cli import cli

from ..conftest import DEMO

pytestmark = pytest.mark.integration


def invoke(*args):
    r = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_main_then_a_second_generation_from_the_registry(workspace, tiny, monkeypatch):
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

    # generation 2: parent = a registered version; ZeRO-3 over 2 ranks; a vocabulary rebuilt from the data
    ft = invoke("finetune", "--data", f"runs:/{first['prepare_run_id']}/data", "--init", "models:/gen/1",
                "--vocab", "rebuild", "--draft-vocab-size", "200", "--zero-stage", "3", "--gpus", "2",
                "--steps", "2", "--tokens-per-batch", "512", "--save-every", "2")
    run = client.get_run(ft["run_id"])
    p = run.data.params
    assert p["parent.source"] == "models:/gen/1" and p["parent.layout"] == "speculators"
    assert p["parent.key_remap"] == "none" and p["zero.stage"] == "3" and p["vocab.policy"] == "rebuild"
    assert int(p["vocab.kept"]) + int(p["vocab.added"]) == 200 and int(p["vocab.dropped"]) >= 56
    assert run.data.tags["draftline.parent.model_version"] == "models:/gen/1"
    assert run.data.tags["draftline.parent.run_id"] == client.get_model_version("gen", "1").run_id
    ex = invoke("export", "--run", ft["run_id"], "--registered-model", "gen")  # consolidates ZeRO-3
    mv = client.get_model_version("gen", ex["version"])
    assert mv.tags["parent.source"] == "models:/gen/1" and mv.tags["vocab.draft_size"] == "200"
    assert mv.tags["export.validated"] == "true"

    # three generations: v3 <- v1 <- the tiny parent (external root, with its sha256)
    r = CliRunner().invoke(cli, ["lineage", "gen", ex["version"], "--json"], catch_exceptions=False)
    chain = json.loads(r.stdout)
    assert [g["uri"] for g in chain] == [f"models:/gen/{ex['version']}", "models:/gen/1", "draftline/tiny-parent"]
    assert chain[-1]["kind"] == "root" and len(chain[-1]["sha256"]) == 64
    assert chain[0]["data_digest"] == chain[1]["data_digest"]
    text = CliRunner().invoke(cli, ["lineage", "gen", ex["version"]]).stdout
    assert text.startswith(f"gen/{ex['version']} <- gen/1 <- draftline/tiny-parent (sha256 ")
