"""The package's structure, held by a test (SpecForge's package-architecture test does the same): imports go
down the layers of ``docs/architecture.md`` and never up, the import graph of ``src/draftline`` has no cycle, and
the product and its test kit stay apart: ``draftline.testing`` holds only what a command imports (``make-tiny``'s
tiny models), production never imports the tests' kit (``tests/kit``), and a unit test lives in the folder of the
package it tests. Every import counts, the ones inside functions included: a lazy import is still a dependency."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SRC = ROOT / "src"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
UNIT = ROOT / "tests" / "unit"
TEST_KIT = "draftline.testing"
# The one production module allowed to reach draftline.testing: the CLI's `make-tiny` command builds the demo.
MAY_IMPORT_TEST_KIT = {"draftline.cli.stages"}
# Modules of draftline.testing no module imports, each with the module that copies them as files and why.
COPIED_NOT_IMPORTED = {"draftline.testing.kimi_code": ("draftline.testing.kimi", "the Kimi miniature's custom code")}
# Where a unit test of no one package goes: tests/unit/<package>/ for src/draftline/<package>/, else these.
UNIT_FOLDERS_BESIDE_PACKAGES = {
    "foundation": "the top-level modules of src/draftline (the foundation layer: config, store, environment, ...)",
    "project": "the repository as a whole: docs, layers, history, deployment files, benchmark data",
}


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


def imports_of_the_tests(src: Path = SRC) -> list[str]:
    """``["<module> imports <name>"]`` for every import of the test suite (``tests``, its kit ``tests.kit``) under
    ``src/draftline``: the product never does; an installed wheel has no ``tests``."""
    found = []
    for path in (src / "draftline").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            found += [f"{module_name(path, src)} imports {n}" for n in names if n.split(".")[0] == "tests"]
    return sorted(found)


def unused_kit_modules(graph: dict[str, set[str]], src: Path = SRC) -> list[str]:
    """The modules of ``draftline.testing`` no product module outside it reaches, through any chain of imports
    (a package counts as reached with any of its modules; ``COPIED_NOT_IMPORTED`` only while the module that
    copies it is reached and names its folder)."""
    seen: set[str] = set()
    todo = [m for m in graph if not m.startswith(TEST_KIT)]
    while todo:
        mod = todo.pop()
        if mod not in seen:
            seen.add(mod)
            todo.extend(graph.get(mod, ()))
    for mod in list(seen):
        parts = mod.split(".")
        seen.update(".".join(parts[:i]) for i in range(2, len(parts)))
    for folder, (copier, _why) in COPIED_NOT_IMPORTED.items():
        copier_path = src / (copier.replace(".", "/") + ".py")
        if copier in seen and copier_path.is_file() and f'"{folder.rpartition(".")[2]}"' in copier_path.read_text():
            seen.update(m for m in graph if m == folder or m.startswith(folder + "."))
    return sorted(m for m in graph if m.startswith(TEST_KIT) and m not in seen)


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


def test_production_modules_never_import_the_tests_kit():
    offenders = imports_of_the_tests()
    assert not offenders, offenders


def test_draftline_testing_holds_only_what_a_command_imports():
    """The kit that ships is what `draftline make-tiny` and `make-verifier` import; a fake server or a fixture
    goes to tests/kit, which no wheel carries."""
    unused = unused_kit_modules(import_graph())
    assert not unused, f"no draftline command imports {unused}: move them to tests/kit/"


def test_every_unit_test_lives_in_the_folder_of_what_it_tests():
    """A new unit test's place is decided by what it tests: tests/unit/<package>/ for src/draftline/<package>/,
    else one of UNIT_FOLDERS_BESIDE_PACKAGES (integration tests: tests/integration/; the kit: tests/kit/)."""
    packages = {p.name for p in (SRC / "draftline").iterdir() if (p / "__init__.py").is_file()}
    folders = packages | set(UNIT_FOLDERS_BESIDE_PACKAGES)
    tests = list(UNIT.rglob("test_*.py"))
    misplaced = sorted(str(p.relative_to(UNIT)) for p in tests
                       if len(p.relative_to(UNIT).parts) != 2 or p.parent.name not in folders)
    assert tests and not misplaced, f"move them to tests/unit/<one of {sorted(folders)}>/: {misplaced}"
    assert all((p.parent / "__init__.py").is_file() for p in tests)  # test files of one name in two folders


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
    "the tests' kit": ("export/stage.py", "from tests.kit import localserver"),
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
    elif bad == "the tests' kit":
        assert imports_of_the_tests(tmp_path) == ["draftline.export.stage imports tests.kit"]
    else:
        edited = "draftline." + edits[0].removesuffix(".py").replace("/", ".")
        found = upward_imports(graph)
        assert found and all(f.startswith(f"{edited} imports ") for f in found), found


def test_the_kit_check_catches_a_module_no_command_imports(tmp_path):
    """A fake server added to draftline.testing, imported by no command (only by tests): the check must fail."""
    import shutil

    shutil.copytree(SRC / "draftline", tmp_path / "draftline", symlinks=True)
    (tmp_path / "draftline" / "testing" / "fake_server.py").write_text("from draftline.testing import tiny\n")
    assert unused_kit_modules(import_graph(tmp_path), tmp_path) == ["draftline.testing.fake_server"]
    assert unused_kit_modules(import_graph()) == []


def test_the_module_map_names_every_module():
    """docs/architecture.md is the map a newcomer reads: every module under src/draftline is named in it."""
    text = ARCHITECTURE.read_text()
    missing = sorted(str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
                     if p.name != "__init__.py" and p.name not in text)
    assert not missing, f"docs/architecture.md does not name: {', '.join(missing)}"


def test_a_test_in_tests_unit_is_a_unit_test():
    """The quick loop runs tests/unit: nothing there is marked integration or benchmark (those live in
    tests/integration, where `pytest -m` and the tiers expect them)."""
    marked = [str(p.relative_to(UNIT)) for p in UNIT.rglob("test_*.py")
              if re.search(r"pytest\.mark\.(integration|benchmark)|marks=pytest\.mark\.", p.read_text())]
    assert marked == [], marked
