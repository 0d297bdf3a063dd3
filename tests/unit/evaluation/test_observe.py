"""`draftline observe`: a serving vLLM's spec-decode counters over a window, recorded on the version it serves
and compared with its evaluation. The servers here are HTTP servers exposing vLLM's metric names (real vLLM
serves them in tests/integration/test_kimi.py); the registry is real."""

import hashlib
import json

import mlflow
import pytest
from click.testing import CliRunner
from mlflow import MlflowClient

from draftline import names
from draftline.cli import cli
from draftline.drafter.aux_ids import served_aux_fields
from draftline.evaluation.observe import window
from draftline.registry.versions import model_id_of
from draftline.util import manifest_digest

from ...kit.vllm_metrics import metrics_server
from ..registry.test_registry import _version


@pytest.fixture
def server():
    with metrics_server() as served:
        yield served


def _pulled(tmp_path, client, measured, folder="pulled"):
    """A registered version evaluated at ``measured`` (16 prompts, interval of width 0) and its pulled dir."""
    mlflow.set_experiment("observe")
    unique = hashlib.sha256(str(tmp_path / folder).encode()).hexdigest()  # one version per test on a shared server
    files = {"config.json": unique, "model.safetensors": "b" * 64}
    mv = _version(client, "kimi-drafter", 1.5, measured=measured, **{names.EXPORT_SHA256: manifest_digest(files)})
    pulled = tmp_path / folder
    pulled.mkdir()
    (pulled / "checksums.json").write_text(json.dumps(files))
    (pulled / "config.json").write_text(json.dumps({"architectures": ["Eagle3DeepseekV2ForCausalLM"],
                                                    **served_aux_fields([1, 29, 57])}))
    return mv, pulled


def _traffic(counters, drafts, per_pos):
    """Traffic served inside the first window: right after its opening read of /metrics (read 2; read 1 is
    the check before the run)."""
    counters.script[2] = (drafts, per_pos)


def test_a_window_is_recorded_on_the_version_it_serves(server, tmp_path, store):
    counters, endpoint = server
    client = MlflowClient()
    mv, pulled = _pulled(tmp_path, client, measured=2.0)
    counters.serve(50, [40, 20, 10])  # before the window: not counted
    _traffic(counters, 100, [80, 50, 30])  # 1 + 160 / 100 = 2.6: at or above the evaluation
    r = CliRunner().invoke(cli, ["observe", "--endpoint", endpoint, "--drafter", str(pulled), "--window", "1",
                                 "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["version"] == mv.version and out["served_acceptance_length"] == 2.6 and out["drafts"] == 100
    assert out["rates"] == [0.8, 0.5, 0.3] and out["below"] is False
    model = client.get_logged_model(model_id_of(mv))
    served = {m.key: m.value for m in model.metrics if m.key.startswith("served/")}
    assert served["served/acceptance_length"] == pytest.approx(2.6) and served["served/drafts"] == 100
    assert served["served/generated_tokens"] == 100 + 160  # a token per step and the accepted ones, this model's
    assert model.tags[names.SERVED_VERDICT] == "as evaluated"
    params = client.get_run(out["run_id"]).data.params
    assert params["endpoints"] == endpoint


def test_below_the_evaluation_exits_1_for_an_alert(server, tmp_path, store):
    counters, endpoint = server
    client = MlflowClient()
    mv, pulled = _pulled(tmp_path, client, measured=2.5)
    _traffic(counters, 100, [30, 10, 0])  # 1.4 served against 2.5 evaluated
    r = CliRunner().invoke(cli, ["observe", "--endpoint", endpoint, "--drafter", str(pulled), "--window", "1"])
    assert r.exit_code == 1 and "BELOW" in r.output
    assert client.get_logged_model(model_id_of(mv)).tags[names.SERVED_VERDICT] == "below evaluation"


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)  # the windows' logic is the command's, not the store's
def test_as_a_sidecar_each_window_is_recorded_and_a_quiet_one_is_said_and_skipped(server, tmp_path, store):
    """--every-minutes: one window after another on the same run and version; a window without traffic records
    nothing and the next is tried; a window below the evaluation makes the sidecar's exit 1 at the end."""
    counters, endpoint = server
    client = MlflowClient()
    mv, pulled = _pulled(tmp_path, client, measured=2.0)
    # /metrics reads: 1 the check before the run; then two per window (its start and end)
    counters.script = {2: (100, [80, 50, 30]), 6: (100, [30, 10, 0])}  # 2.6, a quiet window, then 1.4
    before = len(client.search_runs([e.experiment_id for e in client.search_experiments()],
                                    "tags.`draftline.observe.version` != ''"))
    r = CliRunner().invoke(cli, ["observe", "--endpoint", endpoint, "--drafter", str(pulled), "--window", "1",
                                 "--every-minutes", "0.02", "--windows", "2", "--json"], catch_exceptions=False)
    assert r.exit_code == 1 and counters.reads == 7, r.output
    assert "no traffic in the window; nothing was recorded" in r.stderr
    out = json.loads(r.stdout)
    assert out["below"] is True and out["served_acceptance_length"] == 1.4
    history = client.get_metric_history(out["run_id"], "served/acceptance_length")
    assert [(m.step, round(m.value, 4)) for m in history] == [(0, 2.6), (1, 1.4)]
    below = client.get_metric_history(out["run_id"], "served/below_evaluation")
    assert [m.value for m in sorted(below, key=lambda m: m.step)] == [0.0, 1.0]
    model = client.get_logged_model(model_id_of(mv))
    assert model.tags[names.SERVED_VERDICT] == "below evaluation" and model.tags[names.SERVED_OBSERVE_RUN] == out["run_id"]
    observed = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                  "tags.`draftline.observe.version` != ''")
    assert len(observed) == before + 1  # one run for every window


@pytest.mark.parametrize("store", ["sqlite"], indirect=True)
def test_as_a_sidecar_it_follows_the_version_serve_switches_to(server, tmp_path, store):
    """`draftline serve` points DEST/serving at the version vLLM runs. The sidecar finds the version again at
    every window: a window during which it changed is said and not recorded, and the next windows go to the new
    version, in a run of its own."""
    counters, endpoint = server
    client = MlflowClient()
    old, _ = _pulled(tmp_path, client, measured=2.0, folder="v1")
    new, _ = _pulled(tmp_path, client, measured=2.0, folder="v2")
    serving = tmp_path / "serving"
    serving.symlink_to("v1")

    def switch():
        serving.unlink()
        serving.symlink_to("v2")

    # /metrics reads: 1 the check; 2-3 a window on v1; 4-5 a window the switch lands in; 6-7 a window on v2
    counters.script = {2: (100, [80, 50, 30]), 4: (100, [10, 0, 0]), 5: switch, 6: (100, [60, 40, 20])}
    r = CliRunner().invoke(cli, ["observe", "--endpoint", endpoint, "--drafter", str(serving), "--window", "1",
                                 "--every-minutes", "0.02", "--windows", "2", "--json"], catch_exceptions=False)
    assert r.exit_code == 0 and counters.reads == 7, r.output
    assert f"the version served changed during the window (v{old.version} to v{new.version}); nothing was " \
           "recorded" in r.stderr
    assert f"now serving models:/kimi-drafter/{new.version} (was v{old.version})" in r.stderr
    out = json.loads(r.stdout)
    assert out["version"] == new.version and out["served_acceptance_length"] == 2.2
    for mv, value in ((old, 2.6), (new, 2.2)):
        served = {m.key: m.value for m in client.get_logged_model(model_id_of(mv)).metrics}
        assert served["served/acceptance_length"] == pytest.approx(value), (mv.version, served)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()],
                              "tags.`draftline.observe.model` = 'kimi'")
    assert sorted(run.data.tags[names.OBSERVE_VERSION] for run in runs) == [
        f"models:/kimi-drafter/{old.version}", f"models:/kimi-drafter/{new.version}"]


@pytest.mark.parametrize("problem", ["no traffic", "no drafter", "unknown version", "no server", "nested-only ids"])
def test_bad_input_is_one_line_and_records_nothing(problem, server, tmp_path, store):
    counters, endpoint = server
    client = MlflowClient()
    mv, pulled = _pulled(tmp_path, client, measured=2.0)
    runs_before = len(client.search_runs([e.experiment_id for e in client.search_experiments()]))
    if problem == "no drafter":
        counters.spec = False
    if problem == "unknown version":
        (pulled / "checksums.json").write_text(json.dumps({"config.json": "c" * 64}))
    if problem == "no server":
        endpoint = "http://127.0.0.1:9/v1"
    if problem == "nested-only ids":  # as exports wrote an MLA drafter before: a GPU server ignores them
        (pulled / "config.json").write_text(json.dumps({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1]}}))
    r = CliRunner().invoke(cli, ["observe", "--endpoint", endpoint, "--drafter", str(pulled), "--window", "1"])
    assert r.exit_code not in (0, None) and "Traceback" not in r.output
    assert len([x for x in r.output.strip().splitlines() if x.startswith("error")]) == 1, r.output
    words = {"no traffic": "no traffic in the window", "no drafter": "exposes no vllm:spec_decode",
             "unknown version": "is no registered version", "no server": "unreachable",
             "nested-only ids": "config.json: vLLM's runners read different aux layers"}[problem]
    assert words in r.output, r.output
    assert len(client.search_runs([e.experiment_id for e in client.search_experiments()])) == runs_before
    assert names.SERVED_VERDICT not in client.get_logged_model(model_id_of(mv)).tags


def test_a_restarted_server_counts_from_its_restart_and_servers_are_summed():
    def read(drafts, per):
        return {"num_drafts": drafts, "num_draft_tokens": 3 * drafts, "num_accepted_tokens": sum(per),
                "num_accepted_tokens_per_pos": dict(enumerate(per))}

    w = window([read(500, [300, 200, 100]), read(10, [5, 2, 1])],
               [read(40, [30, 20, 10]), read(110, [85, 52, 31])], 60.0)  # the first restarted
    assert (w.drafts, w.accepted, w.resets, w.servers) == (140, 60 + 160, 1, 2)
    assert w.per_pos == {0: 110, 1: 70, 2: 40}
