"""Where a version stands, on the embedded sqlite store and on a real `mlflow server`: the alias is the truth
and the stage always equals it; --demote, no-op promotions, rollback, a promoter killed between its writes, a
stale lock, and `list` / `compare`."""

import json
from datetime import datetime, timedelta, timezone

import mlflow
import pytest
from click.testing import CliRunner
from mlflow import MlflowClient

from draftline import names
from draftline.cli import cli
from draftline.registry.stages import LOCK_SUFFIX

from .test_registry import _version


def run(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def agree(client, name):
    """Stage holders equal alias targets, stage by stage."""
    aliases = client.get_registered_model(name).aliases
    for stage in ("Production", "Staging"):
        held = sorted(str(v.version) for v in client.search_model_versions(f"name='{name}'")
                      if v.current_stage == stage)
        want = [str(aliases[stage.lower()])] if stage.lower() in aliases else []
        assert held == want, (stage, held, aliases)
    return {a: str(v) for a, v in aliases.items()}


@pytest.fixture()
def client(store, request):
    mlflow.set_experiment(f"promotion-{request.node.name}")
    return MlflowClient()


def test_stage_and_alias_agree_through_demote_noop_and_rollback(client):
    name = f"d-{client.tracking_uri[:4]}"
    for acc in (1.5, 1.6, 1.7):
        _version(client, name, acc)
    assert run("promote", name, "1", "--to", "Production").exit_code == 0
    assert agree(client, name) == {"production": "1"}

    r = run("promote", name, "1", "--to", "Production")  # the holder again: a no-op that says so
    assert r.exit_code == 0 and "already holds Production" in r.output and "nothing changed" in r.output
    r = run("promote", name, "1", "--to", "Production", "--dry-run")
    assert "already holds Production; nothing would change" in r.output

    r = run("promote", name, "1", "--to", "Staging")  # would leave Production empty
    assert r.exit_code == 1 and "holds Production" in r.output and "--demote" in r.output
    assert agree(client, name) == {"production": "1"}

    assert run("promote", name, "2", "--to", "Staging").exit_code == 0
    assert run("promote", name, "2", "--to", "Production").exit_code == 0  # Staging -> Production
    assert agree(client, name) == {"production": "2"}  # @staging left with it
    assert client.get_model_version(name, "1").current_stage == "Archived"

    # rollback: back to v1, past the "not worse than current" rule, recorded
    r = run("rollback", name, "--reason", "acceptance fell in serving")
    assert r.exit_code == 0, r.output
    assert "models:/" + name + "/1 is Production again" in r.output
    assert agree(client, name) == {"production": "1"}
    tags = client.get_model_version(name, "1").tags
    assert tags["rolled_back.reason"] == "acceptance fell in serving" and tags["rolled_back.from"] == "2"
    assert run("rollback", name, "--to", "3", "--reason", "try v3").exit_code == 0
    assert agree(client, name) == {"production": "3"}

    r = run("promote", name, "3", "--to", "Staging", "--demote")
    assert r.exit_code == 0 and agree(client, name) == {"staging": "3"}  # Production empty, as asked
    r = run("rollback", name, "--reason", "x")
    assert r.exit_code == 1 and "nothing to roll back" in r.output


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
def test_rollback_keeps_the_integrity_rules(client):
    name = "integrity"
    _version(client, name, 1.5, **{names.TRAIN_PAIRING: ""})  # trained before the pairing fix
    _version(client, name, 1.5)
    client.set_registered_model_alias(name, "production", "1")  # from an older registry
    client.transition_model_version_stage(name, "1", "Production")
    assert run("promote", name, "2", "--to", "Production").exit_code == 0
    r = run("rollback", name, "--reason", "back")
    assert r.exit_code == 1 and "FAIL  train.pairing is vllm-shifted" in r.output
    assert agree(client, name) == {"production": "2"}


def test_a_promoter_killed_between_its_writes_is_repaired_by_the_next_command(client):
    name = "killed"
    for _ in range(3):
        _version(client, name, 1.5)
    assert run("promote", name, "1", "--to", "Production").exit_code == 0
    client.set_registered_model_alias(name, "production", "2")  # the alias written, then the promoter died
    assert str(client.get_latest_versions(name, stages=["Production"])[0].version) == "1"  # they disagree now
    # and it left its lock behind, long ago
    client.create_registered_model(name + LOCK_SUFFIX, tags={
        "owner": "ci@elsewhere:1", "since": (datetime.now(timezone.utc) - timedelta(minutes=5)).isoformat()})
    r = run("promote", name, "3", "--to", "Staging")
    assert r.exit_code == 0, r.output
    assert f"[draftline] stage Production of {name} was on v1 but @production on v2: moved the stage to v2, as " \
           f"draftline follows the alias; `draftline promote {name} 1 --to Production` if v1 was meant" \
           in r.output.splitlines()  # the repair is said, once
    assert agree(client, name) == {"production": "2", "staging": "3"}
    assert name + LOCK_SUFFIX not in [m.name for m in client.search_registered_models()]


def test_a_stage_moved_in_mlflows_ui_is_named_by_every_command_and_a_pull_refuses(client, tmp_path):
    """MLflow's UI (and its client's transition_model_version_stage) moves the stage and not the alias draftline
    reads: every command that reads the stage names both versions and the command that reconciles them, in one
    line, and a pull of the stage refuses instead of guessing."""
    name = f"ui-{client.tracking_uri[:4]}"
    for acc in (1.5, 1.6):
        _version(client, name, acc)
    assert run("promote", name, "1", "--to", "Production").exit_code == 0
    client.transition_model_version_stage(name, "2", "Production", archive_existing_versions=True)  # the UI's move
    fixes = (f"`draftline promote {name} 2 --to Production` makes v2 both, `draftline promote {name} 1 --to "
             "Production` puts the stage back on v1")
    warning = (f"[draftline] stage Production of {name} is on v2 but @production on v1 (moved outside draftline, "
               f"as MLflow's UI does); draftline reads v1: {fixes}")

    dest = tmp_path / "pod"
    r = run("pull", name, "--stage", "Production", "--dest", str(dest))
    assert r.exit_code == 1
    assert r.output.strip().splitlines() == [
        f"error: models:/{name}/Production is ambiguous: stage Production of {name} is on v2 but @production on v1; "
        f"nothing was pulled: {fixes} (or pull --version)"]
    assert not dest.exists()

    for args in (["lineage", name, "Production"], ["list", name], ["list"], ["compare", name, "Production", "2"],
                 ["promote", name, "2", "--to", "Production", "--dry-run"]):
        r = run(*args)
        assert r.exit_code == 0, (args, r.output)
        said = [line for line in r.output.splitlines() if line.startswith("[draftline]")]
        assert said == [warning], (args, r.output)  # once, whatever else the command prints
    assert run("lineage", name, "Production").stdout.startswith(f"{name}/1 <- ")  # the alias's version
    assert client.get_model_version(name, "2").current_stage == "Production"  # reading changed nothing

    r = run("promote", name, "1", "--to", "Production")  # the reconciling command the lines name
    assert r.exit_code == 0, r.output
    assert f"models:/{name}/1 is now Production" in r.output and "nothing changed" not in r.output
    assert agree(client, name) == {"production": "1"}
    r = run("lineage", name, "Production")
    assert r.exit_code == 0 and "[draftline]" not in r.output  # nothing left to say


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
def test_a_promotion_that_lands_between_a_pulls_two_reads_is_not_a_split(client, monkeypatch):
    """A command reads the stage, then the alias. A promotion whose two writes (alias, then stage) land on
    either side of the first read, its lock let go before the command looks, shows a split the registry never
    had (seen in CI: eight pods pulling under a mover, one refused as "ambiguous"). It is read again, and the
    version that now holds both is the answer, with nothing said."""
    from mlflow.tracking._model_registry.client import ModelRegistryClient

    name = "passing"
    for acc in (1.5, 1.6):
        _version(client, name, acc)
    assert run("promote", name, "1", "--to", "Production").exit_code == 0
    latest, by_alias, writes = ModelRegistryClient.get_latest_versions, MlflowClient.get_model_version_by_alias, []

    def read_stage(self, *args, **kwargs):
        if not writes:  # the promoter's first write lands just before the command reads the stage
            writes.append(MlflowClient().set_registered_model_alias(name, "production", "2"))
        return latest(self, *args, **kwargs)

    def read_alias(self, *args, **kwargs):
        if len(writes) == 1:  # and its second just after
            writes.append(MlflowClient().transition_model_version_stage(name, "2", "Production",
                                                                        archive_existing_versions=True))
        return by_alias(self, *args, **kwargs)

    monkeypatch.setattr(ModelRegistryClient, "get_latest_versions", read_stage)
    monkeypatch.setattr(MlflowClient, "get_model_version_by_alias", read_alias)
    r = run("lineage", name, "Production")
    assert len(writes) == 2 and r.exit_code == 0, r.output
    assert r.stdout.startswith(f"{name}/2 <- ") and "[draftline]" not in r.output


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
def test_list_and_compare(client):
    name = "listed"
    _version(client, name, 1.5)
    _version(client, name, 1.8, **{names.PARENT_SOURCE: f"models:/{name}/1", names.DATA_DIGEST: "ee" * 32})
    assert run("promote", name, "2", "--to", "Production").exit_code == 0
    models = json.loads(run("list", "--json").stdout)
    assert {"name": name, "versions": 2, "latest": 2, "aliases": {"production": "2"}} in models
    assert not any(m["name"].endswith(LOCK_SUFFIX) for m in models)
    text = run("list", name).stdout
    assert "@production" in text and "1.8000" in text and f"models:/{name}/1" in text
    table = json.loads(run("compare", name, "2", "--json").stdout)
    assert table["columns"] == ["v2", "parent v1"]  # the parent comes along
    assert table["rows"][names.VAL_ACCEPTANCE_LENGTH] == ["1.8", "1.5"]
    assert table["rows"]["stage"] == ["Production", "None"]
    text = run("compare", name, "1", "2").stdout
    assert "data.digest*" in text and "init " in text
    r = run("list", "no-such-model")
    assert r.exit_code == 1 and "registered model no-such-model does not exist" in r.output


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
def test_a_lock_let_go_while_mlflow_reads_the_clash_back_is_taken_on_the_next_try(client, monkeypatch):
    """MLflow's SQL store answers a clash on the lock's name by reading the holder back; when the holder has
    just deleted it, the clash arrives as RESOURCE_DOES_NOT_EXIST (seen in CI with eight racing promoters)."""
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST

    name = "letgo"
    _version(client, name, 1.5)
    real, tries = MlflowClient.create_registered_model, []

    def create(self, model, *args, **kwargs):
        if model.endswith(LOCK_SUFFIX) and not tries:
            tries.append(model)
            raise MlflowException(f"Registered Model with name={model} not found", RESOURCE_DOES_NOT_EXIST)
        return real(self, model, *args, **kwargs)

    monkeypatch.setattr(MlflowClient, "create_registered_model", create)
    r = run("promote", name, "1", "--to", "Production")
    assert r.exit_code == 0, r.output
    assert tries and agree(client, name) == {"production": "1"}


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
def test_a_stale_lock_another_promoter_has_just_taken_over_is_left_to_it(client, monkeypatch):
    """Two promoters find the same stale lock; the first takes it over. The second must not delete the first's
    fresh lock: it reads the lock again before deleting, sees another token, and waits instead."""
    name = "takeover"
    _version(client, name, 1.5)
    lock = name + LOCK_SUFFIX
    client.create_registered_model(lock, tags={"owner": "ci@elsewhere:1", "token": "first",
                                               "since": datetime.now(timezone.utc).isoformat(timespec="seconds")})
    real, reads = MlflowClient.get_registered_model, []

    def get(self, model):
        found = real(self, model)
        if model == lock and not reads:  # what the second promoter read a moment before the first took over
            reads.append(model)
            found._tags = {"owner": "ci@elsewhere:1", "token": "stale",
                           "since": (datetime.now(timezone.utc) - timedelta(minutes=5)).isoformat()}
        return found

    monkeypatch.setattr(MlflowClient, "get_registered_model", get)
    monkeypatch.setenv("DRAFTLINE_PROMOTION_WAIT_S", "1")
    r = run("promote", name, "1", "--to", "Production")
    assert r.exit_code == 1 and f"another promotion of {name} has held {lock}" in r.output
    assert real(client, lock).tags["token"] == "first"  # the first promoter's lock is still there
