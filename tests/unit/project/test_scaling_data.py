"""The scaling benchmark's data: the team's pool of GSM8K prompts never holds one the parent was built on, keeps
the order earlier runs were measured (and their replies cached) in, and a size past it is refused in one line
before any server starts."""

import json
import subprocess
import sys
from pathlib import Path

from benchmarks import scaling

ROOT = Path(__file__).resolve().parents[3]


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_team_pool_holds_no_prompt_of_the_parents(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    pool = _records(scaling.team_pool(tmp_path))
    train = _records(ROOT / scaling.TRAIN)
    parents = {r["messages"][0]["content"] for r in train[-scaling.PARENTS_SHARE:]}
    assert len(pool) == 1800
    assert not parents & {r["messages"][0]["content"] for r in pool}
    assert len({r["messages"][0]["content"] for r in pool}) == len(pool)  # no question twice
    assert pool[:768] == train[:768]  # the subsets measured before keep their order, so their cached replies


def test_a_size_past_the_pool_is_refused_before_any_server():
    r = subprocess.run([sys.executable, "-m", "benchmarks.run", "scaling", "--sizes", "64,5000"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "each size must be 1..1800" in r.stderr and "Traceback" not in r.stderr
