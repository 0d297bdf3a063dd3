"""The mistakes a newcomer makes in the first hour: each one sentence, a non-zero exit, and nothing left behind
(no failed run for a typo, no tracking store created by a command that only reads)."""

from pathlib import Path

from click.testing import CliRunner

from draftline import names
from draftline.cli import cli


def _invoke(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def _one_message(r) -> str:
    lines = [ln for ln in r.output.strip().splitlines() if ln.strip()]
    assert r.exit_code != 0 and "Traceback" not in r.output, r.output
    assert len(lines) == 1 or r.exit_code == 2, r.output  # click's usage errors add the usage line
    return r.output


def test_five_input_mistakes_each_say_one_thing_and_leave_no_run(workspace, prepared, tmp_path):
    from mlflow import MlflowClient

    client = MlflowClient()
    client.create_registered_model("tiny-drafter")
    typo_config = tmp_path / "finetune.yaml"
    typo_config.write_text("learning_rate: 0.01\n")
    mistakes = {
        "unknown init": (["finetune", "--data", str(prepared), "--init", "aq-media"], "did you mean 'aq-medai'?"),
        "data run that does not exist": (["finetune", "--data", "runs:/0123456789abcdef0123456789abcdef/data",
                                          "--init", "tiny"], "run 0123456789abcdef0123456789abcdef does not exist in"),
        "stage typo": (["finetune", "--data", str(prepared), "--init", "models:/tiny-drafter/Prodution"],
                       "did you mean 'Production'?"),
        "config key typo": (["finetune", "--config", str(typo_config), "--data", str(prepared)],
                            "did you mean 'lr'?"),
        "missing path": (["finetune", "--data", str(tmp_path / "no-such-data"), "--init", "tiny"],
                         "is neither a directory nor a runs:/ URI"),
        "evaluate: unknown target": (["evaluate", "--target", "tinyy", "--data", str(prepared)],
                                     "did you mean 'tiny'?"),
        "export: no such run": (["export", "--run", "0123456789abcdef0123456789abcdef"], "--run: run 0123"),
    }
    for what, (args, message) in mistakes.items():
        out = _one_message(_invoke(*args))
        assert message in out, (what, out)
    experiments = [e.experiment_id for e in client.search_experiments()]
    assert client.search_runs(experiments) == []


def test_read_only_commands_create_no_tracking_store_and_name_the_one_they_looked_for(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    for args in (["lineage", "tiny-drafter", "1"], ["list"], ["list", "tiny-drafter"],
                 ["compare", "tiny-drafter", "1", "2"], ["inspect", "models:/tiny-drafter/1"],
                 ["inspect", "runs:/0123456789abcdef0123456789abcdef/weights"],
                 ["pull", "tiny-drafter", "--stage", "Production", "--dest", str(tmp_path / "pulled")]):
        out = _one_message(_invoke(*args))
        assert f"no tracking store at {uri} (nothing was created)" in out and "MLFLOW_TRACKING_URI" in out, out
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_relative_store_uri_names_the_store_in_the_working_directory(tmp_path, monkeypatch):
    """MLflow's documented ``sqlite:///mlflow.db`` is ./mlflow.db, ``file:mlruns`` is ./mlruns."""
    from draftline.store import store_path

    monkeypatch.chdir(tmp_path)
    assert store_path("sqlite:///mlflow.db") == Path("mlflow.db")
    assert store_path(f"sqlite:///{tmp_path / 'mlflow.db'}") == tmp_path / "mlflow.db"
    assert store_path("file:mlruns") == Path("mlruns") and store_path("file:///srv/mlruns") == Path("/srv/mlruns")
    assert store_path("sqlite://") is None and store_path("http://127.0.0.1:5000") is None


def test_a_name_that_is_not_there_is_named_with_the_store_and_the_closest_match(workspace):
    from mlflow import MlflowClient

    MlflowClient().create_registered_model("tiny-drafter")
    uri = f"sqlite:///{workspace / 'mlflow.db'}"
    for args in (["lineage", "tiny-drafer", "1"], ["list", "tiny-drafer"],
                 ["pull", "tiny-drafer", "--version", "1", "--dest", str(workspace / "pulled")]):
        out = _one_message(_invoke(*args))
        assert uri in out and "did you mean 'tiny-drafter'?" in out, out
    out = _one_message(_invoke("lineage", "tiny-drafter", "Prodution"))
    assert "did you mean 'Production'?" in out


def _exported(tiny, tmp_path, pad_mib=4):
    """A drafter folder as export writes it (config.json, model.safetensors, checksums.json), its weights file
    padded to a few MiB with a frozen embedding so that a whole download would show."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    from draftline.util import file_sha256

    out = tmp_path / "drafter"
    out.mkdir()
    state = load_file(str(tiny["parent"] / "model.safetensors"))
    state["embed_tokens.weight"] = torch.zeros(pad_mib << 20 >> 9, 128)  # 4 bytes x 128 = 512 per row
    save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text((tiny["parent"] / "config.json").read_text())
    sums = {n: file_sha256(out / n) for n in ("config.json", "model.safetensors")}
    (out / "checksums.json").write_text(json.dumps(sums))
    return out


def test_inspect_reads_headers_only_for_a_version_and_a_finetune_run(store, tiny, tmp_path, monkeypatch):
    import json

    import mlflow
    from mlflow import MlflowClient

    monkeypatch.setenv("DRAFTLINE_CACHE_DIR", str(tmp_path / "cache"))
    drafter = _exported(tiny, tmp_path)
    size = (drafter / "model.safetensors").stat().st_size
    assert size > 4 << 20
    with mlflow.start_run(tags={names.STEP: "finetune"}) as run:
        mlflow.log_artifacts(str(drafter), "drafter")
        mlflow.log_artifact(str(drafter / "model.safetensors"), "weights")
    client = MlflowClient()
    client.create_registered_model("tiny-drafter")
    client.create_model_version("tiny-drafter", f"{run.info.artifact_uri}/drafter", run_id=run.info.run_id)
    for target in ("models:/tiny-drafter/1", f"runs:/{run.info.run_id}/checkpoints"):
        r = _invoke("inspect", "--json", target)
        assert r.exit_code == 0, r.output
        info = json.loads(r.output)
        assert info["layout"] == "midlayer" and info["hidden_size"] == 128
        assert 0 < info["bytes_downloaded"] < 1 << 20, info  # headers (and small files), never the weights
    assert "described: the weights the run handed on" in info["note"]
    human = _invoke("inspect", "models:/tiny-drafter/1").output
    assert "models:/tiny-drafter/1: EAGLE-3 drafter, midlayer layout" in human and "bytes downloaded" in human


def test_every_option_of_every_command_has_help():
    import click

    from draftline.cli import cli as group

    missing = []
    for name, command in group.commands.items():
        for param in command.params:
            if isinstance(param, click.Option) and not param.hidden and not (param.help or "").strip():
                missing.append(f"{name} {param.opts[0]}")
    missing += [f"draftline {p.opts[0]}" for p in group.params
                if isinstance(p, click.Option) and not (p.help or "").strip()]
    assert missing == []


def test_a_new_pull_folder_is_made_as_mkdir_would_make_it(tiny, tmp_path):
    import os
    import stat

    from draftline.registry.transfer import fetch_directory

    drafter = _exported(tiny, tmp_path, pad_mib=0)
    old = os.umask(0o022)
    try:
        fetch_directory(str(drafter), tmp_path / "pulled", cache=None, progress=False)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "pulled").stat().st_mode) == 0o755
