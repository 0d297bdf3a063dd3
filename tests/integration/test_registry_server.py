"""The registry against a real `mlflow server` (on sqlite, and on PostgreSQL with basic-auth): eight promotions
racing."""

import os
import subprocess
import sys
import threading

import pytest
from mlflow import MlflowClient

from ..unit.registry.test_registry import _version

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("store", ["server", "postgres"], indirect=True)
def test_eight_racing_promotions_show_exactly_one_production_at_every_observation(store, mechanics_policies):
    """On sqlite every write is serialised by the database itself; on PostgreSQL the server's workers run
    their transactions side by side, and only draftline's lock keeps the promotions apart."""
    client = MlflowClient()
    for _ in range(8):
        _version(client, "race", 1.5)
    seen, stop = [], threading.Event()

    def observe():
        while not stop.is_set():
            seen.append(sum(v.current_stage == "Production" for v in client.search_model_versions("name='race'")))

    watcher = threading.Thread(target=observe)
    watcher.start()
    env = {**os.environ, "DRAFTLINE_PROMOTION_WAIT_S": "900"}  # eight in a row, on a machine others share too
    procs = [subprocess.Popen([sys.executable, "-m", "draftline.cli", "promote", "race", str(k), "--to",
                               "Production"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for k in range(1, 9)]
    errors = [p.communicate(timeout=300)[1] for p in procs]
    stop.set()
    watcher.join()
    assert all(p.returncode == 0 for p in procs), errors
    production = client.get_latest_versions("race", stages=["Production"])
    assert len(production) == 1
    assert str(client.get_model_version_by_alias("race", "production").version) == str(production[0].version)
    # promotions are serialised by the registry-held lock: no observation ever shows two holders
    assert len(seen) > 20 and set(seen) == {0, 1} and seen[-1] == 1, sorted(set(seen))
    assert "race--draftline-promotion-lock" not in [m.name for m in client.search_registered_models()]
    stages = [client.get_model_version("race", str(k)).current_stage for k in range(1, 9)]
    assert stages.count("Production") == 1 and stages.count("Archived") == 7
