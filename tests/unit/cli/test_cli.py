"""The command line as a user meets it: help, and one clear sentence with a non-zero exit for each mistake."""

import json
import re
import shutil

import click
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from draftline import names
from draftline.cli import cli


@pytest.fixture()
def run():
    runner = CliRunner()

    def invoke(*args):
        return runner.invoke(cli, list(args), catch_exceptions=False)
    return invoke


def test_help_lists_every_command_and_stage_settings(run):
    out = run("--help").output
    for cmd in ("prepare", "finetune", "export", "main", "promote", "pull", "inspect", "make-tiny", "make-verifier"):
        assert cmd in out
    ft = run("finetune", "--help").output
    assert "--zero-stage" in ft and "DeepSpeed ZeRO stage" in ft and "[parent|rebuild]" in ft


def test_finetune_help_lists_each_setting_once_under_its_group(run):
    from draftline.config import FinetuneConfig, groups
    from draftline.train.job import PLACE_FIELDS

    ft = run("finetune", "--help").output
    titles = [t for t, _ in groups(FinetuneConfig)]
    assert titles == ["Data", "Parent and drafter", "Optimisation", "ZeRO and ranks", "This node in a multi-node job",
                      "Validation, checkpoints and logging"]
    at = [ft.index(f"\n{t}:\n") for t in titles]
    assert at == sorted(at), "the groups in their order"
    for (title, fields), start, end in zip(groups(FinetuneConfig), at, [*at[1:], len(ft)], strict=True):
        for name in fields:
            flag = "--" + name.replace("_", "-")
            assert ft.count(f"  {flag} ") == 1 and start < ft.index(f"  {flag} ") < end, f"{flag} under {title}"
    assert "Other options:" in ft and ft.index("--resume") > at[-1]
    assert sorted(f for _, fs in groups(FinetuneConfig) for f in fs) == sorted(FinetuneConfig.model_fields)
    # what each node of a multi-node job sets for itself is that group, not a hand-kept list
    assert PLACE_FIELDS == {"nnodes", "node_rank", "master_addr", "master_port", "rendezvous_timeout"}


def test_unknown_init_lists_the_catalog(run, workspace, prepared):
    r = run("finetune", "--data", str(prepared), "--init", "no-such-parent")
    assert r.exit_code == 1
    assert "init 'no-such-parent' is not 'random', a catalog name (aq-medai, kimi-k25-mla, kimi-k26-mla31, kimi-k26-nvidia, tiny, tiny-kimi, tiny-kimi-mla, tiny-kimi-mla31)" in r.output
    assert "Traceback" not in r.output


def _data_for_another_verifier(prepared, tmp_path, **changes):
    from draftline.data.shards import MANIFEST, data_digest

    copy = shutil.copytree(prepared, tmp_path / "other")
    m = json.loads((copy / MANIFEST).read_text())
    m.update(changes, location=str(prepared))
    m["digest"] = data_digest(m)
    (copy / MANIFEST).write_text(json.dumps(m))
    return copy


@pytest.mark.parametrize("changes, message, code", [
    ({"aux_layer_ids": [1, 3, 5]}, "the data has aux layers [1, 3, 5] but parent tiny reads [2, 4, 5]: prepare the "
                                   "data with --aux-layers 2,4,5", 1),
    # a parent made for a verifier of another hidden size: the user's choice of parent, a usage error
    ({"hidden_size": 256}, "parent tiny was trained for a verifier with hidden size 128, but the data was prepared",
     2),
])
def test_data_for_another_verifier_or_other_aux_layers_is_refused(run, workspace, prepared, tmp_path, changes,
                                                                  message, code):
    from mlflow import MlflowClient

    r = run("finetune", "--data", str(_data_for_another_verifier(prepared, tmp_path, **changes)), "--init", "tiny")
    assert r.exit_code == code and message in r.output and "Traceback" not in r.output
    runs = MlflowClient().search_runs([e.experiment_id for e in MlflowClient().search_experiments()])
    assert runs == []  # refused before the run exists: no FAILED run, nothing trained


def test_a_registry_parent_that_does_not_exist(run, workspace, prepared):
    r = run("finetune", "--data", str(prepared), "--init", "models:/no-such-drafter/3")
    assert r.exit_code == 1 and "models:/no-such-drafter/3 does not resolve" in r.output


def test_absent_aq_medai_says_what_to_download_and_where(run, workspace, prepared, monkeypatch):
    monkeypatch.delenv("DRAFTLINE_PARENTS_DIR", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = run("finetune", "--data", str(prepared), "--init", "aq-medai")
    assert r.exit_code == 1
    assert "huggingface-cli download AQ-MedAI/Kimi-K2-Instruct-eagle3" in r.output
    assert "DRAFTLINE_PARENTS_DIR" in r.output


def test_config_file_typo_is_a_usage_error(run, tmp_path):
    cfg = tmp_path / "ft.yaml"
    cfg.write_text("data: /x\nzero_stag: 3\n")
    r = run("finetune", "--config", str(cfg))
    assert r.exit_code == 2
    assert "finetune has no setting 'zero_stag' (did you mean 'zero_stage'?)" in r.output


def test_out_of_range_flag_names_the_field(run):
    r = run("finetune", "--data", "/x", "--zero-stage", "5")
    assert r.exit_code == 2 and "zero_stage: Input should be less than or equal to 3" in r.output


@pytest.mark.parametrize("command", ["prepare", "finetune", "evaluate", "export"])
def test_help_shows_each_settings_type_and_bounds_and_no_measurements(run, command):
    from draftline import config

    model = {"prepare": config.PrepareConfig, "finetune": config.FinetuneConfig,
             "evaluate": config.EvaluateConfig, "export": config.ExportConfig}[command]
    text = " ".join(run(command, "--help").output.split())
    for name, field in model.model_fields.items():
        kind = {int: "INTEGER", float: "FLOAT"}.get(field.annotation)
        if kind:
            assert f"--{name.replace('_', '-')} {kind}" in text, name
    if command == "finetune":
        assert "--steps INTEGER Optimiser steps (--epochs sets them from the data instead). [1<=x]" in text and "--lr FLOAT" in text and "[0<=x<=3]" in text
        assert "--precision [auto|bf16|fp32]" in text
    # figures measured on one machine go stale unseen in help: they live in benchmarks/results
    assert not re.search(r"\d(\.\d+)?x (faster|slower)|on 2 CPU cores|served best", text)


@pytest.mark.parametrize(("flags", "said"), [
    (["--steps", "abc"], "Invalid value for '--steps': 'abc' is not a valid integer"),
    (["--lr", "fast"], "Invalid value for '--lr': 'fast' is not a valid float"),
    (["--allow-pickle", "maybe"], "Invalid value for '--allow-pickle': 'maybe' is not a valid boolean"),
    (["--vocab", "both"], "Invalid value for '--vocab': 'both' is not one of 'parent', 'rebuild'"),
])
def test_a_value_of_the_wrong_type_is_refused_by_click_in_one_line(run, flags, said):
    r = run("finetune", "--data", "/x", *flags)
    errors = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert r.exit_code == 2 and len(errors) == 1 and said in errors[0], r.output


def test_an_empty_value_is_mlprojects_unset_and_takes_the_default(run, monkeypatch):
    from draftline.cli import common

    seen = {}

    def resolve(model, flags, file):  # what the command would build its settings from; then stop
        seen.update(flags)
        raise click.exceptions.Exit(0)

    monkeypatch.setattr(common, "resolve", resolve)
    r = run("export", "--run", "abc", "--registered-model", "m", "--layout", "", "--vllm-check", "")
    given = {k: v for k, v in seen.items() if v is not None}  # None: a flag not given
    assert r.exit_code == 0 and given == {"run": "abc", "registered_model": "m"}, (seen, r.output)


def test_bad_aux_layers(run):
    r = run("prepare", "--conversations", "x", "--verifier", "y", "--aux-layers", "2,thirty")
    assert r.exit_code == 2 and "comma-separated integers" in r.output


def test_inspect_describes_the_tiny_parent(run, tiny):
    r = run("inspect", "--json", str(tiny["parent"]))
    assert r.exit_code == 0
    info = json.loads(r.output)
    assert info["layout"] == "midlayer" and info["hidden_size"] == 128 and info["draft_vocab_size"] == 256
    assert info["aux_layer_ids"] == [2, 4, 5] and len(info["sha256"]) == 64


def test_inspect_mis_shaped_parent_names_the_key(run, tiny, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny["parent"], bad)
    state = load_file(str(bad / "model.safetensors"))
    state["midlayer.hidden_norm.weight"] = torch.ones(64, dtype=torch.bfloat16)
    save_file(state, str(bad / "model.safetensors"))
    r = run("inspect", str(bad))
    assert r.exit_code == 1
    assert "midlayer.hidden_norm.weight is [64] but fc.weight says hidden size 128" in r.output


def test_unreachable_tracking_server(run, workspace, prepared, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    r = run("finetune", "--data", str(prepared), "--init", "random")
    assert r.exit_code == 75  # EX_TEMPFAIL: worth running again once the server is up
    assert "tracking server at http://127.0.0.1:9 is unreachable" in r.output


def test_shipped_configs_validate():
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    from draftline.config import FinetuneConfig
    from draftline.drafter.parents import load_catalog
    from draftline.train.finetune import ds_config

    assert {"aq-medai", "tiny"} <= set(load_catalog())
    from draftline.train.preflight import check_ds_config

    for stage in (1, 2, 3):
        conf = ds_config(FinetuneConfig(data="x", zero_stage=stage, steps=20, precision="bf16"))
        assert DeepSpeedZeroConfig(**conf["zero_optimization"]).stage == stage  # DeepSpeed's own schema
        for world in (1, 8):
            check_ds_config(conf, f"configs/zero{stage}.json", world_size=world)  # and its whole config class
        assert conf["gradient_clipping"] == 0.5 and conf["bf16"] == {"enabled": True}
        assert conf["optimizer"]["params"]["betas"] == [0.9, 0.95]


def test_shipped_policies_validate_and_a_typo_is_refused(tmp_path):
    from draftline.errors import ConfigError
    from draftline.registry.policies import load_policy, policy_path

    assert load_policy(policy_path("Staging")).stage == "Staging"
    assert load_policy(policy_path("Production")).not_worse_than_current.margin == 0.02
    bad = tmp_path / "p.yaml"
    bad.write_text("stage: Production\nmin_metric:\n  val/acceptance_length: 2\n")
    with pytest.raises(ConfigError, match=r"min_metric: unknown key \(did you mean min_metrics\?\)"):
        load_policy(bad)


def test_pull_needs_exactly_one_version_selector_a_usage_error(run, tmp_path):
    for selector in ([], ["--stage", "Production", "--version", "3"]):
        r = run("pull", "drafter", "--dest", str(tmp_path / "d"), *selector)
        assert r.exit_code == 2
        assert r.output.strip().splitlines() == ["error: pass exactly one of --stage, --alias or --version; see "
                                                 "`cli pull --help`"]  # `draftline pull --help` from the shell
    assert not (tmp_path / "d").exists()


def test_clicks_own_usage_errors_are_one_line_and_help_still_works(run, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("mine")
    for args, said in [
        (["pull", "drafter", "--stage", "Production", "--dest", str(afile)], "error: Invalid value for '--dest': "),
        (["promote", "drafter", "1"], "error: Missing option '--to'."),
        (["promote", "drafter", "1", "--to", "Prod"], "error: Invalid value for '--to': 'Prod' is not one of"),
        (["list", "--bogus"], "error: No such option '--bogus'"),
        (["--bogus"], "error: No such option '--bogus'"),
        (["nosuch"], "error: No such command 'nosuch'"),
    ]:
        r = run(*args)
        lines = r.output.strip().splitlines()
        assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith(said), (args, r.output)
        assert lines[0].endswith("--help`") and "Usage:" not in r.output, (args, r.output)
    assert afile.read_text() == "mine"
    r = run("pull", "--help")
    assert r.exit_code == 0 and r.output.startswith("Usage: cli pull [OPTIONS] [NAME]") and "--dest" in r.output
    assert run().output.startswith("Usage: cli [OPTIONS] COMMAND")  # `draftline` alone: the help, as before


RULE = "use only letters a-z A-Z, digits 0-9, '-', '_' and '.', beginning with a letter or digit"


@pytest.mark.parametrize("name,why", [("my drafter", "it has a space"), ("team/drafter", "it has '/'"),
                                      ("models:/d", "it has '/', ':'"), (".d", "it begins with '.'"),
                                      ("", "it is empty")])
def test_one_rule_for_registered_model_names_in_every_command(run, tmp_path, monkeypatch, name, why):
    """export, main, promote, rollback, pull, list, compare and lineage refuse the same names with the same
    line, before anything is read or written; the line says exactly what a name may hold."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DRAFTLINE_WORK", str(tmp_path / "work"))
    commands = [["export", "--run", "0" * 32, "--registered-model", name],
                ["main", "--conversations", "c.jsonl", "--verifier", "v", "--registered-model", name],
                ["promote", name, "1", "--to", "Production"], ["rollback", name, "--reason", "r"],
                ["pull", name, "--stage", "Production", "--dest", str(tmp_path / "d")], ["list", name],
                ["compare", name, "1"], ["lineage", name, "1"]]
    if name == "":  # an empty flag is MLproject's "unset" (the default name); an empty NAME is refused
        commands = commands[2:]
    for args in commands:
        r = run(*args)
        assert r.exit_code == 2, (args, r.output)
        assert r.output.strip().splitlines() == [f"error: {name!r} cannot be a registered model name ({why}): {RULE}"]
    assert list(tmp_path.iterdir()) == []  # no tracking store, no work folder, no DEST


def test_names_the_rule_allows_pass_it_everywhere():
    from draftline.config import ExportConfig, check_model_name

    for name in ("draftline-drafter", "Kimi-K2.5_eagle3", "7b", "a.b-c_d"):
        assert check_model_name(name) == name
        assert ExportConfig(run="x", registered_model=name).registered_model == name


def test_required_settings_are_marked_required_in_help(run):
    import re

    ft = run("finetune", "--help").output
    data = re.search(r"^\s+--data\b.*?(?=^\s+--)", ft, re.M | re.S).group(0)
    assert "[required]" in data
    assert "[required]" not in re.search(r"^\s+--init\b.*?(?=^\s+--)", ft, re.M | re.S).group(0)


def test_a_missing_required_setting_is_a_usage_error_unless_the_config_file_has_it(run, tmp_path):
    r = run("finetune", "--zero-stage", "2")
    assert r.exit_code == 2 and "Missing option '--data'" in r.output and "Traceback" not in r.output
    cfg = tmp_path / "ev.yaml"
    cfg.write_text("data: /x\n")
    r = run("evaluate", "--config", str(cfg))
    assert r.exit_code == 2 and "Missing option '--target'" in r.output and "'--data'" not in r.output


def test_a_catalog_name_typo_gets_did_you_mean(tmp_path, monkeypatch):
    from draftline.drafter.parents import resolve_init
    from draftline.errors import ParentNotFound

    catalog = tmp_path / "parents.yaml"
    catalog.write_text("parents:\n  aq-medai: {source: AQ-MedAI/Kimi-K2-Instruct-eagle3}\n"
                       "  tiny: {source: draftline/tiny}\n")
    monkeypatch.setenv("DRAFTLINE_PARENTS", str(catalog))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ParentNotFound, match="did you mean 'aq-medai'\\?"):
        resolve_init("aq-media")
    with pytest.raises(ParentNotFound) as e:
        resolve_init("no-such-parent")
    assert "did you mean" not in str(e.value)


def test_a_run_trained_before_the_pairing_fix_is_not_resumed_and_stays_as_it_was(run, workspace, prepared):
    import mlflow
    from mlflow import MlflowClient

    with mlflow.start_run() as old:  # a finetune run from before draftline trained in vLLM's pairing
        mlflow.set_tag(names.STEP, "finetune")
        mlflow.log_param(names.TRAIN_STEPS, "40")
    r = run("finetune", "--data", str(prepared), "--init", "tiny", "--resume", old.info.run_id)
    assert r.exit_code == 1 and "was trained before draftline paired hidden states" in r.output, r.output
    assert "start a new finetune" in r.output
    after = MlflowClient().get_run(old.info.run_id)
    assert after.info.status == "FINISHED" and after.data.params == {names.TRAIN_STEPS: "40"}
