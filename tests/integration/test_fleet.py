"""The team and the fleet, against the README's team setup (`mlflow server` on PostgreSQL, basic-auth, proxied
artifacts): deployments pulling by stage while promotions and rollbacks land, and a tracking server killed
and restarted under pulls and under a promotion."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from tests.kit import fleet
from tests.kit.localserver import start_mlflow_server, stop

from ..conftest import as_admin
from ..unit.registry.test_promotion import agree

pytestmark = pytest.mark.integration


def _pod_user(uri: str) -> tuple[str, str]:
    """A deployment's account: READ on every model (the server's default permission)."""
    from mlflow.server import get_app_client

    user = ("pod", "pod-password-123456")
    try:
        get_app_client("basic-auth", tracking_uri=uri).create_user(*user)
    except Exception:  # noqa: BLE001  (another test made it)
        pass
    return user


def test_eight_pods_pull_production_while_it_moves(team_server, monkeypatch, tmp_path, mechanics_policies):
    """Every pull ends with the complete, verified directory of one version that held Production at some
    moment during that pull, never a mix; the cache four of them share holds only whole blobs."""
    from mlflow import MlflowClient

    as_admin(monkeypatch, team_server)
    client = MlflowClient()
    name = "fleet"
    manifests = fleet.publish(client, name, versions=4, mib=4, root=tmp_path / "exports")
    from draftline.registry.promotion import promote

    promote(client, name, "1", "Production")
    pod = _pod_user(team_server)  # the pods pull with their own READ account
    mover = fleet.Mover(client, name, list(manifests), every_s=0.3).start()
    time.sleep(1.0)  # a change or two before the first pod starts
    pulls = fleet.start_pullers(8, name, tmp_path / "pods", fleet.pull_env(team_server, *pod), shared=4)
    fleet.wait_all(pulls)
    mover.stop()

    assert not mover.errors, mover.errors
    # On a loaded 2-core machine a promotion can wait tens of seconds behind the pulls' requests, so how many
    # changes land varies; what the test needs is that the registry moved while pulls were in flight.
    first, last = min(p.started for p in pulls), max(p.ended for p in pulls)
    assert any(began < last and ended > first for began, ended, _ in mover.changes), \
        f"no promotion or rollback landed while the pulls ran: {mover.changes}"
    problems, versions = [], set()
    for p in pulls:
        result = p.result()
        if result is None:
            problems.append(f"pull failed ({p.proc.returncode}): {p.err[-1500:]}")
            continue
        v = result["version"]
        versions.add(v)
        problems += fleet.check_pull(p.dest, v, manifests)
        if not mover.held_during("1", v, p.started, p.ended):
            problems.append(f"{p.dest} got v{v}, which never held Production during its pull")
    problems += fleet.check_cache(pulls[0].cache)
    assert not problems, "\n".join(problems)
    assert agree(client, name)["production"] == mover.changes[-1][2]


@pytest.fixture()
def restartable(postgres, tmp_path):
    """A team server of its own (PostgreSQL, proxied artifacts) that the test may kill and start again on the
    same port and stores."""
    root, db = tmp_path / "server", postgres.create_database(f"kill_{time.time_ns()}")
    proc, uri = start_mlflow_server(root, backend_store_uri=db, timeout_s=300)
    port = int(uri.rsplit(":", 1)[1])
    state = {"proc": proc}

    def restart(pause_s: float = 2.0) -> float:
        stop(state["proc"], signal.SIGKILL)  # a crash, not a shutdown
        time.sleep(pause_s)
        began = time.monotonic()
        state["proc"] = start_mlflow_server(root, backend_store_uri=db, port=port, timeout_s=300)[0]
        return time.monotonic() - began

    yield uri, restart
    stop(state["proc"])


def _one_message(r_err: str) -> bool:
    return "Traceback" not in r_err and sum(line.startswith("error: ") for line in r_err.splitlines()) == 1


def test_a_server_restarted_mid_pull_and_mid_promotion(restartable, monkeypatch, tmp_path, mechanics_policies):
    """Pulls cut off by a crashed server try again and finish (or stop with one message, exit 75); a
    promotion cut off the same way ends with stage and alias in agreement."""
    import mlflow
    from mlflow import MlflowClient

    uri, restart = restartable
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_tracking_uri(uri)
    client = MlflowClient()
    name = "restarted"
    manifests = fleet.publish(client, name, versions=2, mib=96, root=tmp_path / "exports")
    from draftline.registry.promotion import promote

    promote(client, name, "1", "Production")
    env = {**fleet.pull_env(uri), "DRAFTLINE_RETRY_S": "240"}

    # mid-pull: kill the server once bytes are arriving, start it again
    pulls = fleet.start_pullers(4, name, tmp_path / "pods", env, shared=0)
    deadline = time.monotonic() + 300
    while not any(f.stat().st_size > 0 for p in pulls for f in (p.cache / "blobs").rglob(".incoming-*/*/*")
                  if f.is_file()):
        assert time.monotonic() < deadline and all(p.proc.poll() is None for p in pulls), \
            [p.proc.communicate() for p in pulls]
        time.sleep(0.02)
    restart_s = restart()
    fleet.wait_all(pulls)
    retried = 0
    for p in pulls:
        assert p.proc.returncode in (0, 75), p.err[-3000:]
        if p.proc.returncode == 0:
            assert not fleet.check_pull(p.dest, "1", manifests)
        else:
            assert _one_message(p.err) and not p.dest.exists(), p.err[-3000:]
        retried += "again in" in p.err
        assert not fleet.check_cache(p.cache)
    assert retried, "no pull was cut off by the restart"
    print(f"server restart took {restart_s:.1f} s; {retried} pulls retried; exits "
          f"{[p.proc.returncode for p in pulls]}")

    # mid-promotion: kill the server while the promoter holds the lock, start it again
    promoter = subprocess.Popen([sys.executable, "-m", "draftline.cli", "promote", name, "2", "--to", "Production"],
                                env={**env, "DRAFTLINE_REGISTRY_POLICIES": str(mechanics_policies)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lock = name + "--draftline-promotion-lock"
    deadline = time.monotonic() + 300
    while not any(m.name == lock for m in client.search_registered_models()):
        assert time.monotonic() < deadline and promoter.poll() is None, promoter.communicate()
        time.sleep(0.01)
    restart()
    out, err = promoter.communicate(timeout=600)
    assert promoter.returncode in (0, 75), err[-3000:]
    if promoter.returncode == 0:
        assert "is now Production" in out and agree(client, name) == {"production": "2"}
        assert lock not in [m.name for m in client.search_registered_models()]
    else:
        assert _one_message(err), err[-3000:]
    held = agree(client, name)  # stage and alias agree, whichever way it went
    assert held["production"] in ("1", "2")
