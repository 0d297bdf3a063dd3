"""Fixtures of the integration tier only."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def clean_env() -> dict[str, str]:
    """This process's environment without the settings that point at a tracking store or at this checkout."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "DRAFTLINE_", "PYTHONPATH"))}


@pytest.fixture(scope="session")
def draftline_wheel(tmp_path_factory) -> Path:
    """draftline's wheel, built once from this checkout."""
    wheels = tmp_path_factory.mktemp("wheels")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(wheels), str(ROOT)], check=True, cwd=wheels, env=clean_env())
    return next(wheels.glob("draftline-*.whl"))


@pytest.fixture(scope="session")
def light_install(tmp_path_factory, draftline_wheel) -> dict[str, Path]:
    """A serving host's install, built once: draftline's wheel (``wheel``) and a fresh venv (``venv``) with
    ``pip install draftline`` alone (MLflow's light client; no torch, DeepSpeed, transformers, speculators).
    Needs the package registry, as ./setup.sh does."""
    env, wheel = clean_env(), draftline_wheel
    venv = tmp_path_factory.mktemp("light-install") / "light"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, env=env)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    str(wheel)], check=True, env=env, timeout=600)
    return {"wheel": wheel, "venv": venv}
