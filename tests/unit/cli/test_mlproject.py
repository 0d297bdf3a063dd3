"""MLproject declares every setting of every stage (generated from the typed settings), MLflow's
`--snake_case` spelling of a parameter is accepted, and the logged optimiser params are the ones that ran."""

import json
from pathlib import Path

import yaml
from click.testing import CliRunner

from draftline import names
from draftline.cli import _settings, cli
from draftline.cli.mlproject import STAGES, default_of, render
from draftline.config import FinetuneConfig, PrepareConfig

ROOT = Path(__file__).resolve().parents[3]


def test_mlproject_is_generated_from_the_settings_and_declares_every_one():
    text = (ROOT / "MLproject").read_text()
    assert text == render(), "MLproject is stale: run `python -m draftline.cli.mlproject > MLproject`"
    entry_points = yaml.safe_load(text)["entry_points"]
    for name, model in STAGES.items():
        params = entry_points[name]["parameters"]
        assert set(params) == set(model.model_fields), name
        for key, field in model.model_fields.items():  # every default is the setting's own
            assert params[key].get("default") == default_of(field), (name, key)
            if not field.is_required() and field.default is not None:
                assert str(_settings(model, None, {**{k: "x" for k, f in model.model_fields.items()
                                                      if f.is_required()}, key: params[key]["default"]})
                           .model_dump()[key]).lower().replace(" ", "").strip("[]") == \
                    params[key]["default"].lower(), (name, key)  # and reads back as that default
            assert f"--{key.replace('_', '-')} {{{key}}}" in entry_points[name]["command"]


def test_snake_case_options_as_mlflow_passes_undeclared_parameters(workspace, tmp_path):
    r = CliRunner().invoke(cli, ["finetune", "--data", str(tmp_path / "nothing"), "--val_every", "5",
                                 "--tokens_per_batch=512"])
    assert "No such option" not in r.output
    assert r.exit_code == 1 and "data " in r.output and "is neither a directory nor a runs:/ URI" in r.output


def test_boolean_settings_take_a_value_as_mlproject_passes_them():
    base = {"conversations": "c.jsonl", "verifier": "v"}
    assert _settings(PrepareConfig, None, {**base, "log_shards": "true"}).log_shards is True
    assert _settings(PrepareConfig, None, {**base, "log_shards": "false"}).log_shards is False
    assert _settings(PrepareConfig, None, {**base, "log_shards": ""}).log_shards is False  # MLproject's unset
    assert _settings(PrepareConfig, None, {**base, "log_shards": "true", "no_log_shards": True}).log_shards is False


def test_logged_optimizer_params_are_those_of_the_deepspeed_config_that_runs(tmp_path):
    from draftline.train.finetune import ds_config, optimizer_params

    custom = tmp_path / "ds.json"
    custom.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "optimizer": {
        "type": "AdamW", "params": {"betas": [0.8, 0.99], "eps": 1e-6, "torch_adam": True}}}))
    conf = ds_config(FinetuneConfig(data="-", ds_config=str(custom), lr=3e-4, warmup_steps=7, grad_clip=1.0))
    params = optimizer_params(conf)
    assert conf["optimizer"]["params"]["betas"] == [0.8, 0.99]  # what the engine is built from
    assert str(params["optimizer.betas"]) == "(0.8, 0.99)" and params["optimizer.eps"] == 1e-6
    assert params[names.OPTIMIZER_LR] == 3e-4 and params[names.OPTIMIZER_WARMUP_STEPS] == 7
    assert params["optimizer.grad_clip"] == 1.0
    default = optimizer_params(ds_config(FinetuneConfig(data="-")))
    assert str(default["optimizer.betas"]) == "(0.9, 0.95)"  # configs/zero2.json, EAGLE's reference
