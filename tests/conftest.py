"""Shared fixtures: the tiny verifier/parent (built once per session), its prepared data, tracking stores,
and a real ``mlflow server`` on loopback."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo" / "conversations.jsonl"

os.environ.setdefault("LOGURU_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.pop("MLFLOW_TRACKING_URI", None)
os.environ.pop("MLFLOW_RUN_ID", None)
# Real vLLM (the venv of `./setup.sh --vllm`) only where a test asks for it (the `vllm_python` fixture): export's
# vLLM check and evaluate's vLLM backend would otherwise start a vLLM server in every test that exports.
from draftline.serving.engine import PYTHON_ENV as _VLLM_ENV  # noqa: E402
from draftline.serving.engine import vllm_python as _find_vllm  # noqa: E402

try:
    VLLM_PYTHON = _find_vllm()
except Exception:  # noqa: BLE001 (a bad DRAFTLINE_VLLM_PYTHON: the vLLM tests say so when they skip)
    VLLM_PYTHON = None
os.environ[_VLLM_ENV] = "off"


def pytest_addoption(parser):
    parser.addoption("--all", action="store_true", default=False,
                     help="Run the whole suite (unit + integration), as .ci/run does; benchmarks stay out.")


def pytest_configure(config):
    """`pytest -q` is the quick loop (unit tests); `--all` the full suite; an explicit `-m` always wins."""
    if config.getoption("--all"):
        config.option.markexpr = "not benchmark"
    elif not config.option.markexpr:
        config.option.markexpr = "not benchmark and not integration"


@pytest.fixture(autouse=True)
def _no_mlflow_state_from_other_tests(monkeypatch):
    """MLflow keeps the experiment in the environment (MLFLOW_EXPERIMENT_ID) and in a module global; neither
    may leak from one test into the next."""
    for var in ("MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID", "MLFLOW_TRACKING_URI", "DRAFTLINE_TRUST_REMOTE_CODE"):
        monkeypatch.delenv(var, raising=False)
    import mlflow

    mlflow.tracking.fluent._active_experiment_id = None
    yield
    while mlflow.active_run():
        mlflow.end_run()


# vLLM servers, draftline's commands and DeepSpeed's ranks and launchers, told by what they run (not by the path
# of the venv they run from, which may hold any name); a session fixture's mlflow server or PostgreSQL, started
# on first use inside a test, is the session's and is left alone
_TEST_MODULES = ("vllm.entrypoints", "draftline.cli", "draftline.train", "deepspeed", "torch.distributed")


def _started_by_a_test(cmdline: list[str]) -> bool:
    program = Path(cmdline[0]).name if cmdline else ""
    return program in ("draftline", "vllm", "deepspeed", "torchrun") or any(
        arg.startswith(_TEST_MODULES) or "/deepspeed/launcher/" in arg for arg in cmdline[1:])


@pytest.fixture(autouse=True)
def _nothing_left_running():
    """No test leaves a process of its own running (a vLLM server, a rank, a launcher): whatever a test started
    and did not end is ended here, after its own fixtures, and the test errors naming it, so the next test starts
    on a quiet machine and with its ports free. Processes of longer-lived fixtures (a session's MLflow server)
    were started before this check's snapshot and are left alone."""
    import psutil

    def ours(p: psutil.Process) -> bool:  # what a test starts and must end (not a session's servers)
        with contextlib.suppress(psutil.Error):
            return _started_by_a_test(p.cmdline())
        return False

    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    yield
    left = [p for p in me.children(recursive=True) if p.pid not in before and ours(p)]
    _, alive = psutil.wait_procs(left, timeout=10)  # a process ending on its own is given a moment
    named = []
    for p in alive:
        with contextlib.suppress(psutil.Error):
            named.append(f"{p.pid} {' '.join(p.cmdline()[:4])[:120]}")
            p.kill()
    psutil.wait_procs(alive, timeout=10)
    if named:
        pytest.fail(f"the test left {len(named)} process(es) running (ended now): {'; '.join(named)}")


@pytest.fixture(scope="session")
def tiny(tmp_path_factory, request) -> dict[str, Path]:
    """The tiny verifier and its AQ-MedAI-layout parent. The parent is trained (150 steps) only when an
    integration test runs (warm start is measured there); unit tests need its layout, not its skill, and get a
    random one."""
    from draftline.testing.tiny import make_tiny

    trained = any(item.get_closest_marker("integration") for item in request.session.items)
    return make_tiny(tmp_path_factory.mktemp("tiny"), DEMO, parent_steps=150 if trained else 0, progress=False)


@pytest.fixture(scope="session")
def kimi(tmp_path_factory, request) -> dict[str, Path]:
    """The Kimi-shaped verifier (DeepSeek-V3 as custom code) in its three forms and its three parents (Llama layer
    in AQ-MedAI's layout, MLA layer in lightseek's K2.5 layout and in its K2.6 EAGLE 3.1 one, whole vocabulary),
    trained 60 steps when an integration test runs (the unit tests need their layouts, not their skill)."""
    from draftline.testing.kimi import make_tiny_kimi

    trained = any(item.get_closest_marker("integration") for item in request.session.items)
    return make_tiny_kimi(tmp_path_factory.mktemp("kimi"), DEMO, parent_steps=60 if trained else 0, progress=False)


@pytest.fixture(scope="session")
def tokenizer(tiny):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny["verifier"])


@pytest.fixture(scope="session")
def prepared(tiny, tmp_path_factory) -> Path:
    """Prepared data (no MLflow run) for the tiny verifier: the demo conversations, cut at 256 tokens."""
    from draftline.config import PrepareConfig
    from draftline.data.prepare import build_data

    out = tmp_path_factory.mktemp("prepared") / "data"
    build_data(PrepareConfig(conversations=str(DEMO), verifier=str(tiny["verifier"]), max_length=256,
                             shard_tokens=4096), out, progress=False)
    return out


@pytest.fixture()
def workspace(tmp_path, monkeypatch, tiny):
    """A clean working directory with the embedded default tracking store (sqlite:///$PWD/mlflow.db)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_ID", raising=False)  # mlflow.set_experiment exports it
    monkeypatch.setenv("DRAFTLINE_WORK", str(tmp_path / "work"))
    monkeypatch.setenv("DRAFTLINE_TINY_DIR", str(tiny["parent"].parent))
    monkeypatch.setenv("DRAFTLINE_EXPERIMENT", "tests")
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")  # _no_mlflow_state_from_other_tests cleans up
    yield tmp_path


from tests.kit.localserver import basic_auth as _basic_auth  # noqa: E402
from tests.kit.localserver import start_mlflow_server as _start_server  # noqa: E402
from tests.kit.localserver import stop as _stop  # noqa: E402

ADMIN = ("admin", "admin-password-for-tests-1")


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    proc, uri = _start_server(tmp_path_factory.mktemp("mlflow-server"))
    yield uri
    _stop(proc)


@pytest.fixture()
def vllm_python(monkeypatch):
    """The python of the vLLM venv, switched on for this test (and its subprocesses). Skipped, saying why, where
    there is none, unless DRAFTLINE_REQUIRE_VLLM=1 (.ci/run sets it once it has built .venv-vllm)."""
    if VLLM_PYTHON is None:
        if os.environ.get("DRAFTLINE_REQUIRE_VLLM") == "1":
            pytest.fail("DRAFTLINE_REQUIRE_VLLM=1 but there is no vLLM venv (.venv-vllm): ./setup.sh --vllm")
        pytest.skip("no vLLM venv (.venv-vllm): ./setup.sh --vllm builds it")
    monkeypatch.setenv(_VLLM_ENV, str(VLLM_PYTHON))
    return VLLM_PYTHON


@pytest.fixture(scope="session")
def postgres():
    """A PostgreSQL cluster of its own (``initdb`` + ``pg_ctl`` in a temporary folder, loopback port). Skipped
    with the reason where the server is not installed, unless DRAFTLINE_REQUIRE_POSTGRES=1 (.ci/run sets it
    once it has installed PostgreSQL): then its absence fails the run."""
    from tests.kit.postgres import PostgresUnavailable, start_postgres

    try:
        pg = start_postgres()
    except PostgresUnavailable as e:
        if os.environ.get("DRAFTLINE_REQUIRE_POSTGRES") == "1":
            raise
        pytest.skip(f"PostgreSQL: {e}")
    yield pg
    pg.stop()


@pytest.fixture(scope="session")
def reflink_dir(tmp_path_factory):
    """A folder on a file system that clones (XFS with reflink on a loop device). Skipped with the reason where
    it cannot be made, unless DRAFTLINE_REQUIRE_REFLINK=1 (.ci/run sets it once it has installed xfsprogs)."""
    from tests.kit.reflink import ReflinkUnavailable, reflink_mount

    try:
        with reflink_mount(tmp_path_factory.mktemp("reflink")) as mnt:
            yield mnt
    except ReflinkUnavailable as e:
        if os.environ.get("DRAFTLINE_REQUIRE_REFLINK") == "1":
            raise
        pytest.skip(f"no file system that clones: {e}")


@pytest.fixture()
def small_disk(tmp_path):
    """A function that loop-mounts an ext4 disk of N bytes and returns its folder: a disk too small, or one
    that fills during a write, for real. Skipped with the reason where it cannot be mounted, unless
    DRAFTLINE_REQUIRE_SMALLFS=1 (.ci/run sets it where it can loop-mount as root)."""
    from tests.kit.smallfs import SmallFsUnavailable, small_filesystem

    with contextlib.ExitStack() as stack:
        def mount(size: int, name: str = "disk") -> Path:
            try:
                return stack.enter_context(small_filesystem(tmp_path / name, size))
            except SmallFsUnavailable as e:
                if os.environ.get("DRAFTLINE_REQUIRE_SMALLFS") == "1":
                    raise
                pytest.skip(f"no small file system: {e}")

        yield mount


@pytest.fixture(scope="session")
def team_server(postgres, tmp_path_factory):
    """The README's team setup: ``mlflow server`` on PostgreSQL (runs, registry, and the basic-auth users
    too), proxied artifacts, ``--app-name basic-auth`` with default permission READ; two workers."""
    root = tmp_path_factory.mktemp("mlflow-team")
    extra, env = _basic_auth(root, ADMIN, postgres.create_database("mlflow_auth"))
    proc, uri = _start_server(root, extra, env, backend_store_uri=postgres.create_database("mlflow"), workers=2,
                              timeout_s=300)
    yield uri
    _stop(proc)


def as_admin(monkeypatch, uri: str) -> str:
    """Point MLflow (this process and its children) at ``uri`` as the basic-auth admin."""
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", ADMIN[0])
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", ADMIN[1])
    mlflow.set_tracking_uri(uri)
    return uri


@pytest.fixture(params=["sqlite", "server", pytest.param("postgres", marks=pytest.mark.integration)])
def store(request, workspace, monkeypatch):
    """The registry on the embedded sqlite store, on a real `mlflow server` on loopback (sqlite), and on the
    team setup (`mlflow server` on PostgreSQL with basic-auth and its credential cache, as its admin). The
    PostgreSQL variants run in the full suite (`--all`, as CI), not the quick loop: ~80 s together."""
    if request.param == "server":
        uri = request.getfixturevalue("mlflow_server")
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        import mlflow

        mlflow.set_tracking_uri(uri)
    elif request.param == "postgres":
        as_admin(monkeypatch, request.getfixturevalue("team_server"))
    if request.param != "sqlite":
        monkeypatch.setenv("DRAFTLINE_EXPERIMENT", f"promote-{request.node.name}")
    if request.param == "server":
        request.addfinalizer(_registry_as_found(uri))
    return request.param


def _registry_as_found(uri: str):
    """A shared `mlflow server` outlives its tests, and registered model names are global on it: what a test
    registers there is deleted after it, so the next test's ``create_registered_model`` finds the name free."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    before = {m.name for m in client.search_registered_models(max_results=1000)}

    def restore():
        for m in client.search_registered_models(max_results=1000):
            if m.name not in before:
                client.delete_registered_model(m.name)

    return restore


@pytest.fixture(scope="session")
def auth_server(tmp_path_factory):
    """``mlflow server --app-name basic-auth`` on sqlite: users and permissions; default permission READ."""
    root = tmp_path_factory.mktemp("mlflow-auth")
    extra, env = _basic_auth(root, ADMIN)
    proc, uri = _start_server(root, extra, env)
    yield uri
    _stop(proc)


@pytest.fixture()
def server_workspace(request, workspace, mlflow_server, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    import mlflow

    mlflow.set_tracking_uri(mlflow_server)
    request.addfinalizer(_registry_as_found(mlflow_server))
    return workspace


def copy_tree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.fixture()
def mechanics_policies(tmp_path_factory, monkeypatch):
    """Policies with the integrity rules only (no evaluation gate), for tests of the registry's mechanics
    (races, fleets, restarts) on versions nobody evaluated; DRAFTLINE_REGISTRY_POLICIES reaches subprocesses."""
    folder = tmp_path_factory.mktemp("policies")
    for stage in ("Production", "Staging"):
        (folder / f"{stage.lower()}.yaml").write_text(f"stage: {stage}\n"
                                                     "export_validated: false\n")
    monkeypatch.setenv("DRAFTLINE_REGISTRY_POLICIES", str(folder))
    return folder
