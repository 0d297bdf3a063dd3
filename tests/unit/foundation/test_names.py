"""Every name draftline writes into MLflow is declared once (src/draftline/names.py), the docs' table is rendered
from that declaration, and no other module spells a declared name again."""

from __future__ import annotations

import ast
from pathlib import Path

from draftline import names

ROOT = Path(__file__).resolve().parents[3]
SRC = ROOT / "src" / "draftline"


def test_the_names_page_is_rendered_from_the_declaration():
    page = (ROOT / "docs" / "names.md").read_text()
    assert page == names.markdown(), "docs/names.md is stale: python -m draftline.names > docs/names.md"


def test_each_name_is_declared_once_with_a_meaning():
    declared = names.declared()
    assert len({str(n) for n in declared}) == len(declared), "a name declared twice"
    for n in declared:
        assert n.meaning and n.writer, f"{n} has no meaning or writer"
        assert n.kind in ("param", "tag", "version tag", "metric")
    assert set(names.VERSION_TAG_PARAMS) <= set(declared)
    assert set(names.HEADLINE_METRICS) <= set(declared)


def _spelled_again() -> list[str]:
    spelled = {str(n) for n in names.declared() if not n.family and ("." in n or "/" in n)}
    found = []
    for path in sorted(SRC.rglob("*.py")):
        if path.name == "names.py" and path.parent == SRC:
            continue
        tree = ast.parse(path.read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                      and node.body and isinstance(node.body[0], ast.Expr)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in spelled \
                    and id(node) not in docstrings:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    return found


def test_no_module_spells_a_declared_name_again():
    found = _spelled_again()
    assert not found, "use draftline.names instead of spelling these again:\n" + "\n".join(found)


def test_the_check_sees_a_name_spelled_again(tmp_path, monkeypatch):
    rogue = SRC / "_rogue_for_test.py"
    rogue.write_text('KEY = "parent.source"\n')
    try:
        assert any("_rogue_for_test.py:1: 'parent.source'" in f for f in _spelled_again())
    finally:
        rogue.unlink()


def test_a_name_is_the_string_mlflow_stores():
    assert names.PARENT_SOURCE == "parent.source"
    assert {names.PARENT_SOURCE: 1}["parent.source"] == 1
    assert f"tags.`{names.STEP}`" == "tags.`draftline.step`"
