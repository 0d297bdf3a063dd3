"""The package's structure, held by a test (SpecForge's package-architecture test does the same): imports go
down the layers of ``docs/architecture.md`` and never up, production modules never import the test kit
(``draftline.testing``), and the import graph of ``src/draftline`` has no cycle. Every import counts, the ones
inside functions included: a lazy import is still a dependency."""

import ast
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
ARCHITECTURE = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
TEST_KIT = "draftline.testing"
# The one production module allowed to reach the test kit: the CLI's `make-tiny` command builds the demo.
MAY_IMPORT_TEST_KIT = {"draftline.cli.stages"}


def layers(doc: Path = ARCHITECTURE) -> list[tuple[str, list[str]]]:
    """The table in docs/architecture.md, top layer first: ``[(layer, [components, lowest last])]``. A
    component is a top-level module or package of ``draftline``."""
    rows = re.findall(r"^\| \*\*(\w+)\*\* \| (.+?) \|", doc.read_text(), re.M)
    return [(layer, re.findall(r"`(\w+)`", cell)) for layer, cell in rows]


def rank() -> dict[str, int]:
    """Every component's height: higher may import lower, never the reverse (in a layer, the order of the
    table's cell: a component may import those to its right)."""
    order = [c for _, components in layers() for c in components]
    return {c: len(order) - i for i, c in enumerate(order)}


def component(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    heights = rank()
    found = []
    for mod, deps in graph.items():
        mine = component(mod)
        if mine == "testing" or not mine:
            continue
        for dep in deps:
            theirs = component(dep)
            if theirs == mine or theirs == "testing":  # within a component only cycles count; the kit: below
                continue
            if mine not in heights or theirs not in heights:
                found.append(f"{mod} or {dep} is in no layer of docs/architecture.md")
            elif heights[theirs] > heights[mine]:
                found.append(f"{mod} imports {dep}: {theirs} is above {mine}")
    return sorted(found)


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


def test_every_import_goes_down_the_layers():
    assert {c for _, cs in layers() for c in cs} >= {component(m) for m in import_graph() if component(m)} - {"testing"}
    offenders = upward_imports(import_graph())
    assert not offenders, "\n".join(offenders)


def test_the_import_graph_has_no_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


BAD = {  # the module a bad import is added to (inside a function: lazy imports count), and the import
    "cycle": ("drafter/vocab.py", "from draftline.drafter.shape import layer_config", "drafter/shape.py",
              "from draftline.drafter.vocab import choose"),
    "test kit": ("export/stage.py", "from draftline.testing import tiny"),
    "upward, shared -> stage": ("registry/promotion.py", "from draftline.evaluation.stage import run"),
    "upward, stage -> later stage": ("data/prepare.py", "from draftline.train.finetune import run"),
    "upward, foundation -> shared": ("config.py", "from draftline.registry import lineage"),
}


@pytest.mark.parametrize("bad", list(BAD))
def test_the_checks_catch_a_reintroduced_bad_import(tmp_path, bad):
    """The checks above, run on a copy of the package with one bad import added: they must fail."""
    import shutil

    shutil.copytree(SRC / "draftline", tmp_path / "draftline", symlinks=True)
    edits = BAD[bad]
    for target, extra in zip(edits[::2], edits[1::2], strict=True):
        path = tmp_path / "draftline" / target
        path.write_text(path.read_text() + "\n\ndef _added():\n    " + extra + "\n")
    graph = import_graph(tmp_path)
    if bad == "cycle":
        assert find_cycle(graph) is not None
    elif bad == "test kit":
        assert "draftline.testing" in graph["draftline.export.stage"]
    else:
        edited = "draftline." + edits[0].removesuffix(".py").replace("/", ".")
        found = upward_imports(graph)
        assert found and all(f.startswith(f"{edited} imports ") for f in found), found


def test_the_module_map_names_every_module():
    """docs/architecture.md is the map a newcomer reads: every module under src/draftline is named in it."""
    text = ARCHITECTURE.read_text()
    missing = sorted(str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
                     if p.name != "__init__.py" and p.name not in text)
    assert not missing, f"docs/architecture.md does not name: {', '.join(missing)}"


def test_a_test_in_tests_unit_is_a_unit_test():
    """The quick loop runs tests/unit: nothing there is marked integration or benchmark (those live in
    tests/integration, where `pytest -m` and the tiers expect them)."""
    unit = Path(__file__).resolve().parent
    marked = [p.name for p in unit.glob("test_*.py")
              if re.search(r"pytest\.mark\.(integration|benchmark)|marks=pytest\.mark\.", p.read_text())]
    assert marked == [], marked
