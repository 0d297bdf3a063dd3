"""The package's structure, held by a test (SpecForge's package-architecture test does the same): production
modules never import the test kit (``draftline.testing``), and the import graph of ``src/draftline`` has no
cycle. Every import counts, the ones inside functions included: a lazy import is still a dependency."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
TEST_KIT = "draftline.testing"
# The one production module allowed to reach the test kit: the CLI's `make-tiny` command builds the demo.
MAY_IMPORT_TEST_KIT = {"draftline.cli.stages"}


def module_name(path: Path, src: Path = SRC) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    """``{module: {draftline modules it imports}}`` for every module under ``src/draftline``."""
    files = {module_name(p, src): p for p in (src / "draftline").rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        deps: set[str] = set()
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from . import x, from ..data import y
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]  # `from draftline import plan`
            else:
                continue
            for name in names:
                while name and name not in files:
                    name = name.rpartition(".")[0]
                if name.startswith("draftline") and name != mod and name != "draftline":
                    deps.add(name)
        graph[mod] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state:
                found = visit(dep)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_production_modules_never_import_the_test_kit():
    offenders = sorted(f"{mod} imports {dep}" for mod, deps in import_graph().items() for dep in deps
                       if dep.startswith(TEST_KIT) and not mod.startswith(TEST_KIT)
                       and mod not in MAY_IMPORT_TEST_KIT)
    assert not offenders, offenders


def test_the_import_graph_has_no_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


@pytest.mark.parametrize("bad", ["cycle", "test kit"])
def test_the_checks_catch_a_reintroduced_cycle_or_test_kit_import(tmp_path, bad):
    """The checks above, run on a copy of the package with one bad import added: they must fail."""
    import shutil

    shutil.copytree(SRC / "draftline", tmp_path / "draftline", symlinks=True)
    target = tmp_path / "draftline" / ("vocab.py" if bad == "cycle" else "export.py")
    extra = "from draftline.train.finetune import run\n" if bad == "cycle" else "from draftline.testing import tiny\n"
    target.write_text(target.read_text() + "\n\ndef _added():\n    " + extra)
    graph = import_graph(tmp_path)
    if bad == "cycle":
        assert find_cycle(graph) is not None
    else:
        assert "draftline.testing" in graph["draftline.export"]
