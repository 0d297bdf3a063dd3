"""``docs/results.md``, rendered from ``benchmarks/results/*.json``: one section per result file, its headline
figures as a table (the file's ``summary``; where it has none, its records and scalar fields), and the plots
that lie beside the JSON, copied into ``docs/results/`` so that the manual serves them.

    python -m benchmarks.render_results           # writes docs/results.md and docs/results/*.png
    python -m benchmarks.render_results --check   # exit 1 when either differs from what the JSON renders

No figure is typed by hand: a benchmark rerun (``python -m benchmarks.run NAME``) rewrites its JSON, and this
script the page. ``tests/unit/project/test_docs.py`` fails when the committed page and the JSON disagree.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "results.md"
PLOTS = ROOT / "docs" / "results"

# Fields every result file carries (benchmarks/run.py writes them), shown in the section's header line instead.
META = ("benchmark", "shape", "date", "wall_s", "machine", "summary")
LONG_LIST = 8  # lists longer than this are counted, not printed

HEADER = """\
# Results

Every figure on this page is rendered from the JSON files in `benchmarks/results/` by
`python -m benchmarks.render_results`; nothing here is typed by hand. Rerun a benchmark
(`python -m benchmarks.run NAME`), then the renderer; `python -m benchmarks.render_results --check` (run by
`tests/unit/project/test_docs.py`) fails when this page and the JSON disagree.

What each benchmark compares and the target it is held to: [Benchmarks](benchmarks.md). How to read the real
tier's figures: [A real verifier and the real tier](real-tier.md).
"""


def load(results: Path = RESULTS) -> list[tuple[Path, dict]]:
    """Every result file, by name; files that are not a JSON object are left out."""
    out = []
    for path in sorted(results.glob("*.json")):
        data = json.loads(path.read_text())
        if isinstance(data, dict):
            out.append((path, data))
    return out


def text(value: object) -> str:
    """A value as a table cell: floats to 5 significant digits, short lists joined, Markdown escaped."""
    if isinstance(value, bool):
        s = "yes" if value else "no"
    elif isinstance(value, float):
        s = f"{value:.5g}" if abs(value) < 1e5 else f"{value:.0f}"
        if float(s) == round(value) != value:  # 1.000021 is not 1
            s = f"{value:.6g}"
    elif isinstance(value, list):
        s = " / ".join(text(v) for v in value) if len(value) <= LONG_LIST else f"{len(value)} values"
        return s
    elif value is None:
        s = "—"
    else:
        s = str(value)
    s = re.sub(r"<(?=[A-Za-z/!?])", "&lt;", " ".join(s.split()))  # never read as an HTML tag
    return re.sub(r"([\\`*_\[\]|])", r"\\\1", s)


def code(name: object) -> str:
    """A field name, as code."""
    return f"`{str(name).replace('`', '')}`"


def anchor(stem: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", stem.lower()).strip("-")


def _scalar(value: object) -> bool:
    return value is None or isinstance(value, (str, int, float, bool)) or (
        isinstance(value, list) and all(not isinstance(v, (dict, list)) for v in value))


def _records(value: object) -> bool:
    """A dict of at least two dicts whose values are mostly scalars: a table of rows (variants, evaluations)."""
    if not isinstance(value, dict) or len(value) < 2 or not all(isinstance(v, dict) for v in value.values()):
        return False
    return all(sum(_scalar(x) for x in v.values()) * 2 >= len(v) for v in value.values())


def table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]


def headline(result: dict) -> list[str]:
    """The headline table(s): the ``summary``; without one, each record set and the scalar fields."""
    summary = result.get("summary")
    if isinstance(summary, dict) and summary:
        return table(["figure", "value"], [[text(k), text(v)] for k, v in summary.items()])
    lines: list[str] = []
    for key, value in result.items():
        if key in META or not _records(value):
            continue
        columns = [c for c in dict.fromkeys(c for row in value.values() for c in row)
                   if all(_scalar(row.get(c)) and not (isinstance(row.get(c), list) and len(row[c]) > LONG_LIST)
                          for row in value.values())]
        lines += [f"{code(key)}:", ""] + table([""] + [code(c) for c in columns],
                                           [[text(name)] + [text(row.get(c)) for c in columns]
                                            for name, row in value.items()]) + [""]
    return lines[:-1]


def settings(result: dict) -> str:
    """The file's other scalar fields, on one line: what was run, at which sizes."""
    parts = [f"{code(k)} {text(v)}" for k, v in result.items()
             if k not in META and _scalar(v) and not (isinstance(v, list) and len(v) > LONG_LIST)]
    return " · ".join(parts)


def section(path: Path, result: dict, plots: list[Path]) -> list[str]:
    stem = path.stem
    name, shape = result.get("benchmark", stem), result.get("shape", "")
    machine = result.get("machine") or {}
    facts = [f"`benchmarks/results/{path.name}`"] + [
        f for f in (str(result.get("date", "")), f"{machine['cpus']} CPUs" if "cpus" in machine else "",
                    f"benchmark wall time {text(result['wall_s'])} s" if "wall_s" in result else "") if f]
    lines = [f"## {text(name)}{' · ' + text(shape) if shape else ''} {{#{anchor(stem)}}}", "", " · ".join(facts), ""]
    lines += headline(result) + [""]
    more = settings(result)
    if more:
        lines += [f"Settings: {more}", ""]
    for plot in plots:
        lines += [f"![{plot.stem}](results/{plot.name})", ""]
    return lines


def render(results: Path = RESULTS) -> tuple[str, dict[str, bytes]]:
    """The page's text and the plots it links, ``{file name: bytes}``."""
    files = load(results)
    pngs = sorted(results.glob("*.png"))
    stems = {p.stem for p, _ in files}
    lines = [HEADER, "| benchmark | shape | date | file |", "|---|---|---|---|"]
    for path, result in files:
        lines.append(f"| {text(result.get('benchmark', path.stem))} | [{text(result.get('shape', '—'))}](#{anchor(path.stem)}) "
                     f"| {text(result.get('date', '—'))} | `{path.name}` |")
    lines.append("")
    for path, result in files:
        lines += section(path, result, [p for p in pngs if p.stem == path.stem])
    orphans = [p for p in pngs if p.stem not in stems]
    if orphans:
        lines += ["## Plots", ""] + [f"![{p.stem}](results/{p.name})\n" for p in orphans]
    return "\n".join(lines).rstrip() + "\n", {p.name: p.read_bytes() for p in pngs}


def differences(results: Path = RESULTS, doc: Path = DOC, plots: Path = PLOTS) -> list[str]:
    """What differs between the committed page (and its plots) and what the JSON renders; empty when nothing."""
    page, images = render(results)
    found = []
    if not doc.exists() or doc.read_text() != page:
        found.append(f"{doc.relative_to(ROOT)} differs from what benchmarks/results/*.json renders")
    for name, data in images.items():
        if not (plots / name).exists() or (plots / name).read_bytes() != data:
            found.append(f"{(plots / name).relative_to(ROOT)} differs from benchmarks/results/{name}")
    stale = sorted(p.name for p in plots.glob("*.png") if p.name not in images) if plots.exists() else []
    found += [f"{(plots / n).relative_to(ROOT)} has no benchmarks/results/{n}" for n in stale]
    return found


def write(results: Path = RESULTS, doc: Path = DOC, plots: Path = PLOTS) -> None:
    page, images = render(results)
    doc.write_text(page)
    plots.mkdir(exist_ok=True)
    for name, data in images.items():
        (plots / name).write_bytes(data)
    for stale in plots.glob("*.png"):
        if stale.name not in images:
            stale.unlink()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when the page is out of date")
    args = ap.parse_args(argv)
    if args.check:
        found = differences()
        for line in found:
            print(line, file=sys.stderr)
        if found:
            print("run: python -m benchmarks.render_results", file=sys.stderr)
        return 1 if found else 0
    write()
    print(f"wrote {DOC.relative_to(ROOT)} and {PLOTS.relative_to(ROOT)}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
