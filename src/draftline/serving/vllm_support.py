"""Whether the vLLM draftline would start has an implementation of the verifier's architecture, asked before any
run opens or any server starts.

vLLM's model registry (``vllm/model_executor/models/registry.py``) lists every architecture it implements as
dictionary literals; they are read here with ``ast`` from the vLLM venv's files, without importing vLLM (an
import takes seconds, the read milliseconds). Where the file cannot be found or read, nothing is refused: the
server's own start then reports (:func:`draftline.serving.checks.blame_verifier`).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

from draftline.errors import UsageError
from draftline.serving import hf_model

REGISTRY = Path("vllm") / "model_executor" / "models" / "registry.py"


class ArchitectureNotServed(UsageError):
    """Raised when vLLM has no implementation of the verifier's architecture: the user chose the verifier."""


@functools.lru_cache(maxsize=4)
def served_architectures(python: str) -> frozenset[str] | None:
    """The architectures the vLLM installed beside ``python`` (a venv's ``bin/python``) implements, or None."""
    venv = Path(python).parent.parent
    for registry in sorted(venv.glob(f"lib/python3*/site-packages/{REGISTRY}")):
        try:
            tree = ast.parse(registry.read_text())
        except (OSError, SyntaxError):
            return None
        names: set[str] = set()
        for node in tree.body:
            value: ast.expr | None
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target, value = node.targets[0], node.value
            elif isinstance(node, ast.AnnAssign):
                target, value = node.target, node.value
            else:
                continue
            if isinstance(target, ast.Name) and target.id.endswith("_MODELS") and isinstance(value, ast.Dict):
                names.update(k.value for k in value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str))
        return frozenset(names) or None
    return None


def unserved(verifier: str | Path, python: Path | str | None) -> str | None:
    """Why the vLLM beside ``python`` cannot serve ``verifier`` (no implementation of its architecture), in words,
    or None (it can, or there is no registry to read)."""
    if python is None:
        return None
    known = served_architectures(str(python))
    wanted = [a for a in hf_model.describe(verifier)["architecture"].split(",") if a and a != "unknown"]
    if known is None or not wanted or any(a in known for a in wanted):
        return None
    return (f"vLLM has no implementation of {', '.join(wanted)}, the architecture of the verifier {verifier} "
            "(its config.json)")


def require_served(verifier: str | Path, python: Path | str | None, *, fix: str) -> None:
    """Refuse, in one line naming the architecture and ``fix``, a verifier vLLM has no implementation of."""
    if reason := unserved(verifier, python):
        raise ArchitectureNotServed(f"{reason}: {fix}")
