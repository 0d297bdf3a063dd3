"""ci: how long CI takes, measured as CI runs it: the commit cloned afresh into a temporary folder and its
``.ci/run`` run there (set-up with real vLLM, the linters, the manual, then the README's full test command), with
CI's environment (``CI=true``, no standard input). Records the wall time, the test runner's own count and time,
the exit status, and the CPU it ran on (CPUs of the same machine kind differ). The run's whole output is kept in
``benchmarks/results/tmp/ci-<commit>.log``.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUMMARY = re.compile(r"^(?:=+ )?(?P<counts>(?:\d+ failed, )?\d+ passed.*?) in (?P<secs>[\d.]+)s", re.M)


def _cpuinfo() -> str:
    return Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""


def _cpu() -> str:
    info = _cpuinfo()
    name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "unknown")
    bf16 = "AVX512-BF16" if " avx512_bf16" in info else "no AVX512-BF16"
    return f"{name}, {os.cpu_count()} cores, {'with' if ' amx' in info else 'without'} AMX, {bf16}"


SLOW = re.compile(r"^(?P<secs>[\d.]+)s (?P<when>call|setup|teardown)\s+(?P<test>\S+)$", re.M)


def run(ref: str = "HEAD") -> dict:
    commit = subprocess.run(["git", "rev-parse", ref], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()
    log = ROOT / "benchmarks" / "results" / "tmp" / f"ci-{commit[:12]}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="draftline-ci-") as tmp:
        clone = Path(tmp) / "draftline"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        subprocess.run(["git", "checkout", "-q", commit], cwd=clone, check=True)
        t0 = time.monotonic()
        with log.open("w") as out:
            proc = subprocess.run(["bash", ".ci/run"], cwd=clone, stdin=subprocess.DEVNULL, stdout=out,
                                  stderr=subprocess.STDOUT, env={**os.environ, "CI": "true"})
        wall = time.monotonic() - t0
    text = log.read_text()
    found = SUMMARY.findall(text)
    counts, secs = found[-1] if found else ("no test summary", "nan")
    slowest = [{"test": m["test"], "when": m["when"], "s": float(m["secs"])} for m in SLOW.finditer(text)][:15]
    return {"summary": {"CI from a fresh clone": f"{wall / 60:.1f} min, exit {proc.returncode}",
                        "pytest -q --all": f"{counts} in {float(secs) / 60:.1f} min",
                        "set-up, linters, manual": f"{(wall - float(secs)) / 60:.1f} min",
                        "CPU": _cpu()},
            "shape": "amx" if " amx" in _cpuinfo() else "no-amx", "slowest": slowest,
            "commit": commit, "returncode": proc.returncode, "wall_s": wall, "pytest_s": float(secs),
            "tests": counts, "cpu": _cpu(), "python": platform.python_version(), "log": str(log.relative_to(ROOT))}
