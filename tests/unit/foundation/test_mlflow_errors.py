"""An MLflow failure means what its code says: absent, exists, denied, unavailable, or an error said as it is.

The judges are checked on what MLflow 3 really raises (a sqlite store, its REST client's answers, a server that
is not there), the registry's modules are read to hold that none takes any failure for "absent", and a refusal
of the lock, the model or the evidence is shown to be said, not read as "there is none"."""

import ast
import textwrap
from pathlib import Path

import mlflow
import pytest
import requests
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException, RestException
from mlflow.protos.databricks_pb2 import (
    INTERNAL_ERROR,
    PERMISSION_DENIED,
    RESOURCE_DOES_NOT_EXIST,
    TEMPORARILY_UNAVAILABLE,
)
from mlflow.utils.rest_utils import verify_rest_response

from draftline.errors import RegistryError, ServerUnavailable, TrackingError
from draftline.mlflow_errors import absent, alias_unset, denied, exists, unavailable
from draftline.registry import confidence, evidence, stages, versions
from draftline.registry.retry import retrying
from draftline.util import free_port

SRC = Path(__file__).resolve().parents[3] / "src" / "draftline"
# the registry's modules, and the foundation's that talk to MLflow
READERS = [*sorted((SRC / "registry").glob("*.py")), SRC / "tracking.py", SRC / "store.py", SRC / "mlflow_errors.py"]
JUDGES = {"absent", "alias_unset", "exists", "denied", "unavailable", "error_code", "raise_failure"}
# where a registry module may catch any failure, and why
ANY_FAILURE = {
    ("retry.py", "retrying"),  # every failure is judged there: only the server's absence is tried again
    ("stages.py", "promotion_lock"),  # deleting the lock after a change: a failure is only said (a warning)
    ("tracking.py", "end_run"),  # the server is away at a run's end: it is told again until it answers
    ("tracking.py", "stage_run"),  # a stage that raises: its run is marked FAILED and the error raised again
    ("tracking.py", "download"),  # MLflow's, requests' or the disk's failure: a refusal said, else one line
}
# where an MlflowException is caught and answered without asking its code
UNJUDGED = {
    ("mlflow_errors.py", "unknown_model_hint"),  # a hint is extra: a registry that does not list gives none
}


# --- the registry's modules: no failure read as "absent" unless its code says so ---------------------------------

def _handlers(source: str, module: str):
    """``(module, function, handler)`` for every ``except`` clause in ``source``."""
    tree = ast.parse(source)
    found = []

    def walk(node, function):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else function
            if isinstance(child, ast.ExceptHandler):
                found.append((module, function, child))
            walk(child, inner)

    walk(tree, "<module>")
    return found


def _caught(handler: ast.ExceptHandler) -> set[str]:
    if handler.type is None:
        return {"BaseException"}
    kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return {k.attr if isinstance(k, ast.Attribute) else getattr(k, "id", "?") for k in kinds}


def _judged(handler: ast.ExceptHandler) -> bool:
    """The handler asks one of mlflow_errors' judges what the failure means, or raises it again as it is (a
    handler raising its own "does not exist" for every failure is what this test is against)."""
    for node in ast.walk(ast.Module(body=handler.body, type_ignores=[])):
        if isinstance(node, ast.Raise) and node.exc is None:
            return True
        if isinstance(node, ast.Call):
            called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if called in JUDGES:
                return True
    return False


def _misreadings(source: str, module: str) -> list[str]:
    wrong = []
    for module_, function, handler in _handlers(source, module):
        caught = _caught(handler)
        where = f"{module_}:{handler.lineno} in {function}()"
        if caught & {"Exception", "BaseException"} and (module_, function) not in ANY_FAILURE:
            wrong.append(f"{where} catches any failure")
        elif "MlflowException" in caught and not _judged(handler) and (module_, function) not in UNJUDGED:
            wrong.append(f"{where} answers an MlflowException without asking its code")
    for node in ast.walk(ast.parse(source)):  # contextlib.suppress(Exception) swallows just the same
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "suppress":
            names = {getattr(a, "id", getattr(a, "attr", "")) for a in node.args}
            if names & {"Exception", "BaseException", "MlflowException"}:
                wrong.append(f"{module}:{node.lineno} suppresses {', '.join(sorted(names))}")
    return wrong


def test_no_registry_or_tracking_module_reads_any_failure_as_absent():
    """A 403, a 500, a bug: none of them means "not there". Only ``retry.retrying``, the lock's clean-up and a
    run's end catch any failure; every ``except MlflowException`` raises or asks its code (mlflow_errors)."""
    wrong = [w for path in READERS for w in _misreadings(path.read_text(), path.name)]
    assert wrong == [], "\n".join(wrong)


@pytest.mark.parametrize("bad", [
    """
    def holder(client, name):
        try:
            return client.get_registered_model(name)
        except Exception:  # noqa: BLE001
            return None
    """,
    """
    def evaluations(client, model_id):
        try:
            return client.get_logged_model(model_id).metrics
        except MlflowException:
            return []
    """,
    """
    def holders(client, name):
        try:
            return client.get_registered_model(name).aliases
        except MlflowException as e:
            raise RegistryError(f"registered model {name} does not exist: {e}") from None
    """,
    """
    def lock_held(client, lock):
        with contextlib.suppress(MlflowException):
            client.get_registered_model(lock)
            return True
        return False
    """,
])
def test_the_check_catches_a_failure_read_as_absent(bad):
    assert _misreadings(textwrap.dedent(bad), "stages.py")


def test_the_check_passes_a_failure_judged_by_its_code():
    good = """
    def holder(client, name):
        try:
            return client.get_registered_model(name)
        except MlflowException as e:
            if not absent(e):
                raise_failure(e, "read it", "READ permission on it")
            return None
    """
    assert _misreadings(textwrap.dedent(good), "stages.py") == []


# --- the judges, on what MLflow raises ------------------------------------------------------------------------------

@pytest.fixture()
def sqlite(tmp_path, monkeypatch):
    """An MlflowClient on a fresh sqlite store (runs, LoggedModels and the registry)."""
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)  # the registry follows it (as the workspace fixture leaves it)
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def _raised(fn) -> Exception:
    """What ``fn()`` raised (what MLflow raises is the subject)."""
    try:
        fn()
    except Exception as e:
        return e
    raise AssertionError("nothing was raised")


def test_what_a_sqlite_store_raises_reads_as_its_code_says(sqlite, tmp_path):
    sqlite.create_registered_model("m")
    with mlflow.start_run() as run:
        pass
    missing = {
        "registered model": _raised(lambda: sqlite.get_registered_model("nope")),
        "version": _raised(lambda: sqlite.get_model_version("m", "3")),
        "stage of a missing model": _raised(lambda: sqlite._get_registry_client().get_latest_versions("nope", ["Production"])),
        "LoggedModel": _raised(lambda: sqlite.get_logged_model("m-0123456789abcdef0123456789abcdef")),
        "run": _raised(lambda: sqlite.get_run("0123456789abcdef0123456789abcdef")),
        "artifact": _raised(lambda: sqlite.download_artifacts(run.info.run_id, "per_prompt.jsonl", str(tmp_path))),
    }
    for what, e in missing.items():
        assert isinstance(e, MlflowException), what
        assert absent(e) and not (exists(e) or denied(e) or unavailable(e)), what
    clash = _raised(lambda: sqlite.create_registered_model("m"))
    assert exists(clash) and not (absent(clash) or denied(clash) or unavailable(clash))
    # an alias that is not set: MLflow says INVALID_PARAMETER_VALUE, not RESOURCE_DOES_NOT_EXIST
    unset = _raised(lambda: sqlite.get_model_version_by_alias("m", "production"))
    assert alias_unset(unset) and not absent(unset) and not unavailable(unset)


def test_what_the_rest_client_raises_reads_as_its_code_says():
    refused = RestException({"error_code": "PERMISSION_DENIED", "message": "Permission denied"})
    assert denied(refused) and not (absent(refused) or unavailable(refused))
    assert absent(RestException({"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "Registered Model not found"}))
    assert exists(RestException({"error_code": "RESOURCE_ALREADY_EXISTS", "message": "already exists"}))
    assert denied(MlflowException("no", error_code=PERMISSION_DENIED))
    assert unavailable(MlflowException("restarting", error_code=TEMPORARILY_UNAVAILABLE))
    # basic-auth answers a refusal with a bare 403 ("Permission denied", no JSON): MLflow names it by its status
    bare = requests.Response()
    bare.status_code, bare._content = 403, b"Permission denied"
    e = _raised(lambda: verify_rest_response(bare, "/api/2.0/mlflow/registered-models/get"))
    assert denied(e) and not absent(e)
    # a download through the server's artifact proxy raises requests' HTTPError with the status
    for status, judge in ((404, absent), (403, denied), (503, unavailable), (502, unavailable)):
        answer = requests.Response()
        answer.status_code = status
        assert judge(requests.HTTPError(f"{status} error", response=answer)), status
    # a code that says something else is not an absence, whatever its words
    assert not absent(MlflowException("Registered Model not found", error_code=INTERNAL_ERROR))
    assert not unavailable(MlflowException("Connection refused by policy", error_code=RESOURCE_DOES_NOT_EXIST))


def test_a_server_that_is_not_there_is_unavailable_not_absent(monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    uri = f"http://127.0.0.1:{free_port()}"
    e = _raised(lambda: MlflowClient(tracking_uri=uri, registry_uri=uri).get_registered_model("m"))
    assert unavailable(e) and not (absent(e) or denied(e))
    # only the words are left where MLflow gathered a download's failures into one message
    gathered = MlflowException("The following failures occurred while downloading one or more artifacts from "
                               "http://h/a:\n##### File x #####\n('Connection aborted.', RemoteDisconnected(...))")
    assert unavailable(gathered)
    assert not unavailable(MlflowException("The following failures occurred: 500 Internal Server Error"))
    assert not unavailable(requests.exceptions.SSLError("certificate verify failed: max retries exceeded"))


# --- a refusal is said, not read as "there is none" -----------------------------------------------------------------

def _refuse(*_args, **_kwargs):
    raise RestException({"error_code": "PERMISSION_DENIED", "message": "Permission denied"})


def test_a_refused_read_of_the_promotion_lock_is_not_no_promotion_in_flight(sqlite, monkeypatch):
    assert stages.promotion_in_progress(sqlite, "m") is False  # no lock: none in flight
    monkeypatch.setattr(MlflowClient, "get_registered_model", _refuse)
    with pytest.raises(TrackingError, match=r"lacks READ permission on registered model "
                                            r"m--draftline-promotion-lock"):
        stages.promotion_in_progress(sqlite, "m")


def test_a_refused_read_of_the_lock_after_a_clash_is_said_not_waited_out(sqlite, monkeypatch):
    sqlite.create_registered_model("m" + stages.LOCK_SUFFIX, tags={"token": "theirs", "since": stages.now()})
    monkeypatch.setattr(MlflowClient, "get_registered_model", _refuse)
    with pytest.raises(TrackingError, match="permission denied"), stages.promotion_lock(sqlite, "m", timeout_s=60):
        pass


def test_a_refused_read_of_the_model_is_said_and_nothing_is_created(sqlite, monkeypatch):
    monkeypatch.setattr(MlflowClient, "get_registered_model", _refuse)
    with pytest.raises(TrackingError, match="lacks READ permission on registered model drafts, needed to register"):
        versions.register(sqlite, "drafts", model_id="m-1", run_id="r", tags={}, description="")
    assert sqlite.search_registered_models() == []  # not "cannot create": no create was tried


def test_a_model_that_is_absent_is_created_once_and_a_concurrent_creator_is_fine(sqlite, monkeypatch):
    real_create = MlflowClient.create_registered_model

    def create_after_another(self, name, *args, **kwargs):  # another exporter created it a moment earlier
        real_create(self, name)
        return real_create(self, name, *args, **kwargs)

    monkeypatch.setattr(MlflowClient, "create_registered_model", create_after_another)
    with pytest.raises(RegistryError, match="cannot register a version of drafts"):  # no such LoggedModel
        versions.register(sqlite, "drafts", model_id="m-1", run_id="r", tags={}, description="")
    assert [m.name for m in sqlite.search_registered_models()] == ["drafts"]


def test_a_refused_alias_read_is_said_and_an_unset_alias_is_a_registry_from_before_the_aliases(sqlite, monkeypatch):
    sqlite.create_registered_model("m")
    with mlflow.start_run() as run:
        pass
    mv = sqlite.create_model_version("m", source=f"{run.info.artifact_uri}/model", run_id=run.info.run_id)
    sqlite.transition_model_version_stage("m", mv.version, "Production")
    assert stages.resolve_stage(sqlite, "m", "Production").version == mv.version  # no alias: the stage
    monkeypatch.setattr(MlflowClient, "get_model_version_by_alias", _refuse)
    with pytest.raises(TrackingError, match="lacks READ permission on registered model m, needed to read @production"):
        stages.resolve_stage(sqlite, "m", "Production")


def test_refused_evidence_is_said_and_missing_evidence_is_none(sqlite, monkeypatch):
    assert evidence.evaluations_of(sqlite, "m-0123456789abcdef0123456789abcdef") == []  # not there
    with mlflow.start_run() as run:
        pass
    assert confidence.read_per_prompt(sqlite, run.info.run_id, "ab" * 18) is None  # an older evaluation
    monkeypatch.setattr(MlflowClient, "get_logged_model", _refuse)
    with pytest.raises(TrackingError, match="permission denied"):
        evidence.evaluations_of(sqlite, "m-0123456789abcdef0123456789abcdef")
    monkeypatch.setattr(MlflowClient, "download_artifacts", _refuse)
    with pytest.raises(TrackingError, match="permission denied"):
        confidence.read_per_prompt(sqlite, run.info.run_id)


def test_only_the_servers_absence_is_retried(monkeypatch):
    monkeypatch.setattr("draftline.registry.retry.time.sleep", lambda s: None)
    tries = []

    def away():
        tries.append(1)
        raise MlflowException("restarting", error_code=TEMPORARILY_UNAVAILABLE)

    with pytest.raises(ServerUnavailable):
        retrying("read it", away, budget=3)
    assert len(tries) > 1
    tries.clear()
    with pytest.raises(RestException):
        retrying("read it", lambda: tries.append(1) or _refuse())
    assert tries == [1]
    with pytest.raises(MlflowException):
        retrying("read it", lambda: tries.append(1) or _raise(RESOURCE_DOES_NOT_EXIST))
    assert tries == [1, 1]


def _raise(code):
    raise MlflowException("not there", error_code=code)
