"""Faults met for real, no mocks: a disk that fills up during export, and credentials that must reach no
param, tag, artifact or log line.

Everything runs the CLI in subprocesses against ``mlflow server --app-name basic-auth`` as a user with
distinctive secrets, on one prepare + finetune run the module shares (the finetune is one step on one CPU rank:
training is slow here). A full disk is the kernel refusing the write: the export runs under ``RLIMIT_FSIZE``
with ``SIGXFSZ`` ignored, so ``write()`` fails with EFBIG (no tmpfs mount, which CI may not be allowed).
"""

from __future__ import annotations

import base64
import errno
import json
import os
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from draftline import names

from ..conftest import ADMIN, DEMO

pytestmark = pytest.mark.integration

USER = "trainer-faults"
SECRETS = {  # distinctive values: a hit can only be a leak
    "MLFLOW_TRACKING_PASSWORD": "pw-7f3c91-LEAKCHECK-bd0e",
    "MLFLOW_TRACKING_TOKEN": "tok-2a8e55-LEAKCHECK-61c4",
    "OPENAI_API_KEY": "sk-9d4b17-LEAKCHECK-e1f2",
}
# what an Authorization header carrying the password would show instead of the password itself
NEEDLES = {**SECRETS, "basic-auth header": base64.b64encode(
    f"{USER}:{SECRETS['MLFLOW_TRACKING_PASSWORD']}".encode()).decode()}
EXPERIMENT = "faults"
LIMIT = 64 << 10  # bytes: above config.json and the small files, below every weights file of the tiny drafter


def _cli(env: dict, cwd: Path, logs: list, *args, preexec_fn=None, python_code: str | None = None):
    """``draftline ARGS`` in a subprocess (``python -c CODE ARGS`` when ``python_code`` wraps it); its
    stdout and stderr are kept in ``logs`` for the secret scan."""
    head = [sys.executable, "-c", python_code] if python_code else [sys.executable, "-m", "draftline.cli"]
    started = time.monotonic()
    r = subprocess.run([*head, "-vv", *map(str, args)], env=env, cwd=cwd, capture_output=True, text=True,
                       preexec_fn=preexec_fn, timeout=900)
    logs.append((f"draftline {args[0]} ({time.monotonic() - started:.0f} s)", r.stdout, r.stderr))
    return r


def _ok(r) -> dict:
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def pipeline(tiny, auth_server, tmp_path_factory):
    """prepare (regenerating through an OpenAI-compatible endpoint that demands OPENAI_API_KEY) and a
    finished one-step finetune, run by USER with SECRETS in the environment."""
    from mlflow.server import get_app_client

    from tests.kit.tiny_server import serve_in_thread

    root = tmp_path_factory.mktemp("faults")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_USERNAME", ADMIN[0])
        mp.setenv("MLFLOW_TRACKING_PASSWORD", ADMIN[1])
        get_app_client("basic-auth", tracking_uri=auth_server).create_user(
            USER, SECRETS["MLFLOW_TRACKING_PASSWORD"])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "DRAFTLINE_"))}
    env.pop("OPENAI_API_KEY", None)
    env.update(SECRETS, MLFLOW_TRACKING_URI=auth_server, MLFLOW_TRACKING_USERNAME=USER,
               DRAFTLINE_EXPERIMENT=EXPERIMENT, DRAFTLINE_WORK=str(root / "work"),
               DRAFTLINE_CACHE_DIR=str(root / "cache"), DRAFTLINE_TINY_DIR=str(tiny["parent"].parent))
    logs: list = []
    with serve_in_thread(tiny["verifier"], api_key=SECRETS["OPENAI_API_KEY"],
                         served_model_name="tiny-verifier") as endpoint:
        prep = _ok(_cli(env, root, logs, "prepare", "--conversations", DEMO, "--verifier", tiny["verifier"],
                        "--max-length", "256", "--max-samples", "8", "--regenerate-endpoint", endpoint.url,
                        "--regenerate-max-tokens", "16"))
    ft = _ok(_cli(env, root, logs, "finetune", "--data", prep["data_uri"], "--init", "tiny", "--gpus", "1",
                  "--steps", "1", "--tokens-per-batch", "512", "--save-every", "1", "--val-fraction", "0",
                  "--warmup-steps", "0"))
    return SimpleNamespace(root=root, env=env, uri=auth_server, logs=logs, prep=prep, ft=ft)


@pytest.fixture()
def client(pipeline, monkeypatch):
    """An MlflowClient of the server, as USER."""
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", USER)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", SECRETS["MLFLOW_TRACKING_PASSWORD"])
    return MlflowClient(tracking_uri=pipeline.uri, registry_uri=pipeline.uri)


# --- a full disk during export -------------------------------------------------------------------------------

def _ignore_sigxfsz_and_limit(limit: int | None):
    def preexec():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() then fails with EFBIG instead of killing us
        if limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    return preexec


# The export downloads the finetune run's handed-on weights into TMPDIR before it writes the drafter there, and
# the weights file is as large as the drafter's: a limit set at start can only ever hit the download. To fill the disk while the drafter is written, the limit is set when the process first opens
# a file under .../draftline-export-*/drafter/ for writing (save_pretrained writes config.json first).
LIMIT_AT_DRAFTER = f"""
import os, resource, sys

def _limit_at_drafter(event, args):
    if event != "open" or not isinstance(args[0], (str, bytes, os.PathLike)):
        return
    mode, flags = args[1], args[2] or 0
    if not (isinstance(mode, str) and set(mode) & set("wax+")) and not flags & (os.O_WRONLY | os.O_RDWR):
        return
    path = os.fsdecode(os.fspath(args[0]))
    if "draftline-export-" in path and os.sep + "drafter" + os.sep in path:
        resource.setrlimit(resource.RLIMIT_FSIZE, ({LIMIT}, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

sys.addaudithook(_limit_at_drafter)
sys.argv[0] = "draftline"
from draftline.cli import main
main()
"""


@pytest.mark.parametrize("while_writing", ["weights", "drafter"])
def test_a_full_disk_during_export_is_one_error_and_leaves_nothing_behind(pipeline, client, while_writing,
                                                                           tmp_path):
    exp = client.get_experiment_by_name(EXPERIMENT).experiment_id
    exports_before = {r.info.run_id for r in client.search_runs([exp], "tags.`draftline.step` = 'export'")}
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    model = f"full-disk-{while_writing}"
    env = {**pipeline.env, "TMPDIR": str(tmpdir)}
    args = ("export", "--run", pipeline.ft["run_id"], "--registered-model", model)
    if while_writing == "weights":
        r = _cli(env, tmp_path, pipeline.logs, *args, preexec_fn=_ignore_sigxfsz_and_limit(LIMIT))
    else:
        r = _cli(env, tmp_path, pipeline.logs, *args, preexec_fn=_ignore_sigxfsz_and_limit(None),
                 python_code=LIMIT_AT_DRAFTER)

    # one clear line, exit 1, no traceback, no result on stdout
    assert r.returncode == 1, r.stderr[-4000:]
    assert "Traceback" not in r.stderr, r.stderr[-4000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.stderr[-4000:]
    where = re.escape(f"{tmpdir}/draftline-export-") + r"\w+" + (
        r"/weights/(weights/)?model\.safetensors" if while_writing == "weights" else "/drafter")
    assert re.fullmatch(
        rf"error: file too large while writing {where} \(over the file size limit, `ulimit -f`, or the largest "
        r"file its file system takes\): raise the limit or point TMPDIR elsewhere", errors[0]), errors[0]
    assert r.stdout.strip() == ""

    # no half-written export left in TMPDIR (torch may leave its own cache there), no version registered, the
    # export's run FAILED with nothing logged
    assert [p.name for p in tmpdir.iterdir() if p.name.startswith("draftline-export-")] == []
    assert client.search_model_versions(f"name='{model}'") == []
    new = [r for r in client.search_runs([exp], "tags.`draftline.step` = 'export'")
           if r.info.run_id not in exports_before]
    assert len(new) == 1 and new[0].info.status == "FAILED"
    assert new[0].data.tags[names.FINETUNE_RUN] == pipeline.ft["run_id"]
    assert client.list_artifacts(new[0].info.run_id) == []
    assert client.get_run(pipeline.ft["run_id"]).info.status == "FINISHED"


@pytest.mark.parametrize(("raised", "found"), [
    (OSError(errno.ENOSPC, "No space left on device", "/t/a"), (errno.ENOSPC, "/t/a")),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), (errno.EDQUOT, None)),
    (RuntimeError("Error while serializing: I/O error: File too large (os error 27)"), (errno.EFBIG, None)),
    (OSError(errno.EACCES, "Permission denied", "/t/a"), None),
    (RuntimeError("boom"), None),
])
def test_out_of_room_reads_the_errno_wherever_a_library_put_it(raised, found):
    from draftline.disk_space import out_of_room
    from draftline.errors import DataError

    assert out_of_room(raised) == found
    try:  # MLflow's download report, wrapped `from None` by draftline.tracking.download
        try:
            raise RuntimeError("The following failures occurred while downloading one or more artifacts:\n"
                               "##### File checkpoints/step2/x.pt #####\n[Errno 28] No space left on device")
        except RuntimeError:
            raise DataError("cannot download runs:/r/checkpoints") from None
    except DataError as wrapped:
        assert out_of_room(wrapped) == (errno.ENOSPC, "checkpoints/step2/x.pt")


# --- secrets -------------------------------------------------------------------------------------------------

def _corpus(client, pipeline, dest: Path) -> dict[str, bytes]:
    """Everything draftline leaves behind, by where it lies: the stdout/stderr of every CLI call; for every run
    of the experiment its params, tags, metrics (system metrics included), dataset inputs, info and every
    artifact file; every LoggedModel (drafters, external parents) with its params, tags, metrics and artifact
    files; every registered model and version made from those runs; local scratch (DRAFTLINE_WORK,
    the regeneration cache). MLflow's own owner fields (tag ``mlflow.user``, ``user_id``), which hold the
    user name by design, are left out so that the user name can be searched for too."""
    import mlflow
    from mlflow.entities import ViewType

    corpus = {}
    for name, out, err in pipeline.logs:
        corpus[f"{name} stdout"], corpus[f"{name} stderr"] = out.encode(), err.encode()
    exp = client.get_experiment_by_name(EXPERIMENT)
    corpus["experiment"] = json.dumps({"name": exp.name, "tags": exp.tags}).encode()
    runs = client.search_runs([exp.experiment_id], run_view_type=ViewType.ALL)
    for run in runs:
        rid, d = run.info.run_id, run.to_dictionary()
        d["info"].pop("user_id", None)
        tags = {k: v for k, v in run.data.tags.items() if k != "mlflow.user"}
        corpus[f"run {rid} params"] = json.dumps(run.data.params).encode()
        corpus[f"run {rid} tags"] = json.dumps(tags).encode()
        corpus[f"run {rid} info, metrics, inputs"] = json.dumps(
            {k: v for k, v in d.items() if k != "data"} | {"metrics": run.data.metrics}).encode()
        local = Path(mlflow.artifacts.download_artifacts(run_id=rid, artifact_path="", dst_path=str(dest / rid),
                                                         tracking_uri=pipeline.uri))
        for f in sorted(p for p in local.rglob("*") if p.is_file()):
            corpus[f"run {rid} artifact {f.relative_to(local)}"] = f.read_bytes()
    for lm in client.search_logged_models([exp.experiment_id]).to_list():  # drafters and external parents
        corpus[f"model {lm.model_id} params, tags, metrics"] = json.dumps(
            {"params": lm.params, "tags": {k: v for k, v in lm.tags.items() if k != "mlflow.user"},
             "metrics": [(m.key, m.value) for m in lm.metrics or []]}).encode()
        local = Path(mlflow.artifacts.download_artifacts(artifact_uri=lm.artifact_location,
                                                         dst_path=str(dest / lm.model_id), tracking_uri=pipeline.uri))
        for f in sorted(p for p in local.rglob("*") if p.is_file()):
            corpus[f"model {lm.model_id} artifact {f.relative_to(local)}"] = f.read_bytes()
    run_ids = {r.info.run_id for r in runs}
    for rm in client.search_registered_models():
        versions = [v for v in client.search_model_versions(f"name='{rm.name}'") if v.run_id in run_ids]
        if versions:
            corpus[f"registered model {rm.name}"] = json.dumps(
                {"description": rm.description, "tags": rm.tags, "aliases": rm.aliases}).encode()
        for v in versions:
            corpus[f"model version {rm.name}/{v.version}"] = json.dumps(
                {"description": v.description, "tags": v.tags, "source": v.source, "aliases": v.aliases,
                 "run_link": v.run_link}).encode()
    for scratch in ("work", "cache"):
        for f in sorted(p for p in (pipeline.root / scratch).rglob("*") if p.is_file()):
            corpus[f"local {f.relative_to(pipeline.root)}"] = f.read_bytes()
    return corpus


def find(corpus: dict[str, bytes], needles: dict[str, str]) -> set[tuple[str, str]]:
    """``(where, which)`` for every needle found anywhere in the corpus."""
    return {(where, which) for where, blob in corpus.items() for which, s in needles.items() if s.encode() in blob}


def test_credentials_reach_no_param_tag_artifact_version_or_log(pipeline, client, tmp_path):
    ex = _ok(_cli(pipeline.env, tmp_path, pipeline.logs, "export", "--run", pipeline.ft["run_id"],
                  "--registered-model", "faults-drafter"))
    assert client.get_model_version("faults-drafter", ex["version"]).tags[names.EXPORT_VALIDATED] == "true"
    assert client.get_run(pipeline.prep["run_id"]).data.params[names.VERIFIER_NAME_OR_PATH]
    assert any(k.startswith("system/") for k in client.get_run(pipeline.ft["run_id"]).data.metrics)

    # a planted leak in every channel the scan reads, so the scan is shown to find one
    exp = client.get_experiment_by_name(EXPERIMENT).experiment_id
    canary = client.create_run(exp, run_name="planted-leak").info.run_id
    client.log_param(canary, "planted", SECRETS["MLFLOW_TRACKING_PASSWORD"])
    client.set_tag(canary, "planted", SECRETS["MLFLOW_TRACKING_TOKEN"])
    client.log_text(canary, f"key={SECRETS['OPENAI_API_KEY']}\n", "planted/leak.txt")
    client.set_terminated(canary)
    client.create_registered_model("faults-planted")
    client.create_model_version("faults-planted", f"runs:/{canary}/planted", run_id=canary,
                                tags={"planted": NEEDLES["basic-auth header"]})
    pipeline.logs.append(("planted log", "", f"Authorization: Basic {NEEDLES['basic-auth header']}\n"))
    try:
        corpus = _corpus(client, pipeline, tmp_path / "artifacts")
    finally:
        pipeline.logs.pop()
    planted = {(f"run {canary} params", "MLFLOW_TRACKING_PASSWORD"),
               (f"run {canary} tags", "MLFLOW_TRACKING_TOKEN"),
               (f"run {canary} artifact planted/leak.txt", "OPENAI_API_KEY"),
               ("model version faults-planted/1", "basic-auth header"),
               ("planted log stderr", "basic-auth header")}

    # the scan covered what it should: every stage's logs, runs, artifacts and the registered version
    assert {w.split(" (")[0] for w in corpus if w.startswith("draftline ")} >= {
        "draftline prepare", "draftline finetune", "draftline export"}
    assert f"run {pipeline.ft['run_id']} artifact weights/selection.json" in corpus  # the handed-on weights
    from draftline.registry.versions import model_id_of

    drafter = model_id_of(client.get_model_version("faults-drafter", ex["version"]))
    assert f"model {drafter} artifact model.safetensors" in corpus
    assert f"model version faults-drafter/{ex['version']}" in corpus
    assert find(corpus, NEEDLES) == planted  # anything more is a leak, named by where it lies
    assert find(corpus, {"user name": USER}) == set()  # only MLflow's owner fields hold it
