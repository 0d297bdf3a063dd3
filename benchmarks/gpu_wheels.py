"""The wheels the GPU check carries to a machine that has its own CUDA PyTorch and transformers.

    python -m benchmarks.gpu_wheels list                 what would be carried (from this venv's versions)
    python -m benchmarks.gpu_wheels build DIR            download / build them for CPython 3.12, x86-64 Linux
    python -m benchmarks.gpu_wheels install DIR          on the GPU machine: install those not installed there

What is carried: the installed distributions that DeepSpeed, speculators (its declared dependencies less
torchvision/torchaudio, which it does not use), MLflow and draftline require, at this venv's versions, less
everything torch and transformers require (the GPU machine's image has those), less ``datasets`` (see
``NOT_USED``). The total must stay within
``LIMIT`` (what a device run can carry): when it does not, the wheels in ``DROP_FIRST`` are left out first
(libraries a CUDA image usually ships), then the largest; ``MANIFEST.json`` says what was left out, and a
part of the check whose imports then fail is recorded as skipped with the import error.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

LIMIT = 64 * 2**20
ROOTS = ("deepspeed", "speculators", "mlflow", "draftline")
HAS = ("torch", "transformers")  # the GPU machine's image: these and what they require
# speculators declares torchvision/torchaudio and never imports them; it imports ``datasets`` (pyarrow + pandas:
# ~62 MB) only for its own trainer's loading, and the check puts a stand-in on the path where it is missing
# (benchmarks/standins/datasets)
NOT_USED = {"torchvision", "torchaudio", "datasets"}
# left out first, group by group, when the total is over the limit: what neither the check nor a sqlite
# tracking store imports (MLflow's server, auth and model flavours), then the accuracy chart's matplotlib (finetune
# skips the chart without it), then libraries a CUDA image usually ships. pandas stays: MLflow's LoggedModels
# import it.
DROP_FIRST = (("scipy",), ("scikit-learn", "joblib", "threadpoolctl"), ("pyarrow",),
              ("cryptography", "cffi", "pycparser", "docker", "graphene", "graphql-core", "graphql-relay", "gunicorn",
               "huey", "skops", "flask-wtf", "wtforms", "flask-cors"),
              ("matplotlib", "pillow", "fonttools", "kiwisolver", "contourpy", "cycler", "pyparsing"),
              ("pandas",), ("numpy",))
TARGET = ["--python-version", "3.12", "--implementation", "cp", "--abi", "cp312", "--platform",
          "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64",
          "--platform", "manylinux1_x86_64", "--platform", "linux_x86_64"]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requires(dist: str) -> list[str]:
    try:
        reqs = metadata.requires(dist) or []
    except metadata.PackageNotFoundError:
        return []
    out = []
    for r in reqs:
        if "extra ==" in r and "extra == \"auth\"" not in r:  # mlflow[auth] is what draftline asks for
            continue
        out.append(_norm(re.split(r"[ ;<>=!\[~(]", r, maxsplit=1)[0]))
    return out


def closure(roots) -> set[str]:
    seen, stack = set(), [_norm(r) for r in roots]
    while stack:
        name = stack.pop()
        if name in seen or name in NOT_USED:
            continue
        seen.add(name)
        stack += _requires(name)
    return seen


def wanted() -> dict[str, str]:
    """``{distribution: version}`` to carry, installed here."""
    out = {}
    for name in sorted(closure(ROOTS) - closure(HAS) - {"draftline"}):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue  # not installed here (an optional marker): not needed by what runs
    return out


def _pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)


def _dist_of(wheel: Path) -> str:
    return _norm(wheel.name.split("-")[0])


def build(out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    want = wanted()
    pins = [f"{k}=={v}" for k, v in want.items()]
    failed = []
    if _pip("download", "--no-deps", "--only-binary=:all:", *TARGET, "-d", str(out), *pins).returncode:
        for pin in pins:  # one at a time: those without a wheel for the target are built here
            if _pip("download", "--no-deps", "--only-binary=:all:", *TARGET, "-d", str(out), pin).returncode and \
                    _pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(out), pin).returncode:
                failed.append(pin)
    wheels = {_dist_of(w): w for w in out.glob("*.whl")}
    for w in out.glob("*"):  # sdists pip kept beside what it built
        if w.suffix != ".whl" and w.name != "MANIFEST.json":
            w.unlink()
    left_out = []
    groups = [[d for d in map(_norm, g) if d in wheels] for g in DROP_FIRST]
    dropped = {d for g in groups for d in g}
    groups += [[d] for d in sorted((d for d in wheels if d not in dropped), key=lambda d: -wheels[d].stat().st_size)]
    while sum(w.stat().st_size for w in wheels.values()) > LIMIT:
        for name in groups.pop(0):
            left_out.append({"name": name, "bytes": wheels[name].stat().st_size})
            wheels.pop(name).unlink()
    manifest = {"carried": sorted(w.name for w in wheels.values()), "left_out": left_out, "failed": failed,
                "bytes": sum(w.stat().st_size for w in wheels.values()), "limit": LIMIT,
                "python": "cp312 manylinux x86_64", "from": {"python": sys.version.split()[0]}}
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def install(src: Path) -> dict:
    """Install the carried wheels whose distribution is not installed here (the image's own stay)."""
    wheels = sorted(src.glob("*.whl"))
    todo = []
    for w in wheels:
        try:
            metadata.version(_dist_of(w))
        except metadata.PackageNotFoundError:
            todo.append(w)
    res = _pip("install", "--no-index", "--no-deps", "--quiet", *map(str, todo)) if todo else None
    return {"carried": len(wheels), "installed": [w.name for w in todo],
            "pip_rc": res.returncode if res else 0, "pip_err": (res.stderr[-2000:] if res and res.returncode else "")}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("list", "build", "install") or (argv[0] != "list" and len(argv) != 2):
        print(__doc__, file=sys.stderr)
        return 2
    if argv[0] == "list":
        print(json.dumps(wanted(), indent=2))
        return 0
    res = build(Path(argv[1])) if argv[0] == "build" else install(Path(argv[1]))
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
