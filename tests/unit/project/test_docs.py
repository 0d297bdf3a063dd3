"""The docs kept honest (SpecForge's recipe-README test does the same for its configs): the results page is what
the benchmark JSON renders, every code fence is closed, every ``draftline …`` command shown parses with today's
CLI, and the manual's nav lists every page."""

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[3]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
SOURCES = [README, *sorted(DOCS.rglob("*.md"))]

FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)")
GROUP_OPTIONS = {"-v", "-vv", "-vvv", "--verbose", "--version", "-h", "--help"}
DRAFTLINE = re.compile(r"(?:^|\s)(?:[\w.~$-]*/)?draftline\s+(.*)$")  # draftline, .venv/bin/draftline; not draftline.x
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
INLINE_COMMAND = re.compile(r"^(?:[A-Z_]+=\S*\s+)*(?:[\w.~$-]*/)?draftline\s")
SEGMENT = re.compile(r"&&|\|\||\s\|\s|;|\$\(")  # shell command separators; `A|--b` alternatives stay together


def split_fences(text: str) -> tuple[list[tuple[str, list[str]]], list[str], int | None]:
    """``(fenced blocks as (language, lines), the lines outside fences, the line an unclosed fence opened on)``."""
    blocks, prose, opened, marker, lang, body = [], [], None, "", "", []
    for number, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if opened is None and m:
            opened, marker, lang, body = number, m.group(1), m.group(2).lower(), []
        elif opened is not None and line.strip().startswith(marker[0] * len(marker)) \
                and not line.strip().strip(marker[0]):
            blocks.append((lang, body))
            opened = None
        elif opened is not None:
            body.append(line)
        else:
            prose.append(line)
    return blocks, prose, opened


def shell_lines(lang: str, lines: list[str]) -> list[str]:
    """The commands a fence shows: backslash continuations joined, comments dropped; in a ``console`` fence only
    the lines after a ``$`` prompt (the rest is output), and a line cut short with "…" loses its last word (it
    may be cut too)."""
    out, pending = [], ""
    for line in lines:
        if lang == "console" and not pending:
            if not line.lstrip().startswith("$ "):
                continue
            line = re.sub(r"\S*\s*…\s*$", "", line.lstrip()[2:])
        line = re.sub(r"(^|\s)#.*$", "", line)
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append((pending + line).rstrip())
        pending = ""
    return out + ([pending.rstrip()] if pending else [])


def inline_code(prose: list[str]) -> list[str]:
    """Inline code spans, paragraph by paragraph (a span may wrap onto the next line)."""
    spans = []
    for paragraph in re.split(r"\n\s*\n", "\n".join(prose)):
        spans += [" ".join(m.group(2).split()) for m in re.finditer(r"(`+)(.+?)\1", paragraph, re.S)]
    return spans


def shown_commands() -> list[tuple[str, str]]:
    """Every ``draftline …`` command the README and the manual show: ``(where, the command's arguments)``. In a
    fence, anywhere on a command line; in inline code, a span that starts with the command (after environment
    assignments), so that prose quoted in code (``… not a draftline export``) is not taken for one."""
    found = []
    for path in SOURCES:
        blocks, prose, _ = split_fences(path.read_text())
        snippets = [line for lang, body in blocks for line in shell_lines(lang, body)]
        snippets += [span for span in inline_code(prose) if INLINE_COMMAND.match(span)]
        for snippet in snippets:
            for segment in SEGMENT.split(snippet):
                if m := DRAFTLINE.search(segment):
                    found.append((path.name, m.group(1).strip()))
    return found


def problems_with(args: str, commands: dict) -> list[str]:
    words = args.split()
    while words and words[0].startswith("-"):
        if words[0] not in GROUP_OPTIONS:
            return [f"draftline has no option {words[0]}"]
        words.pop(0)
    if not words or not re.fullmatch(r"[a-z][a-z0-9-]*", words[0]):
        return []  # `draftline` alone, or a placeholder: `draftline <stage> --help`
    name, rest = words[0], " ".join(words[1:]).split(" -- ", 1)[0]  # after `--`: vLLM's own flags (serve)
    if name not in commands:
        return [f"draftline has no command {name!r}"]
    opts = {"--help"} | {o for p in commands[name].params for o in (*p.opts, *p.secondary_opts)}
    return [f"draftline {name} has no option {flag}" for flag in FLAG.findall(rest) if flag not in opts]


def test_the_results_page_is_what_the_benchmark_json_renders():
    from benchmarks.render_results import differences

    assert differences() == [], "run: python -m benchmarks.render_results"


def test_every_code_fence_is_closed():
    unclosed = [f"{p.relative_to(ROOT)}:{line}" for p in SOURCES if (line := split_fences(p.read_text())[2])]
    assert unclosed == [], f"a code fence opened here is never closed: {unclosed}"


def test_every_draftline_command_shown_parses_with_todays_cli():
    from draftline.cli import cli

    shown = shown_commands()
    assert len(shown) > 50 and any(args.startswith("finetune") for _, args in shown), shown  # the scan found them
    problems = [f"{where}: `draftline {args}`: {p}" for where, args in shown for p in problems_with(args, cli.commands)]
    assert problems == []


def test_the_checker_catches_a_wrong_command_and_a_wrong_flag():
    from draftline.cli import cli

    assert problems_with("finetune --init aq-medai --learning-rate 1", cli.commands) == \
        ["draftline finetune has no option --learning-rate"]
    assert problems_with("train --data x", cli.commands) == ["draftline has no command 'train'"]
    assert problems_with("-v prepare --trust-remote-code --capture-backend vllm", cli.commands) == []
    assert problems_with("<stage> --help", cli.commands) == []
    assert problems_with("serve d --stage Production --dest x -- --tensor-parallel-size 8", cli.commands) == []
    assert problems_with("serve d --tensor-parallel-size 8", cli.commands) == [
        "draftline serve has no option --tensor-parallel-size"]
    lines = shell_lines("bash", ["draftline prepare --verifier v \\", "  --name evaluation   # --not-a-flag"])
    assert lines == ["draftline prepare --verifier v    --name evaluation"]
    assert shell_lines("console", ["$ draftline list", "draftline --bogus output"]) == ["draftline list"]
    assert shell_lines("console", ["$ draftline finetune --steps 6 --tokens-per- …"]) == ["draftline finetune --steps 6"]


def test_the_nav_lists_every_page_and_only_pages_that_exist():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())

    def pages(node):
        if isinstance(node, str):
            return [node] if node.endswith(".md") else []
        items = node.values() if isinstance(node, dict) else node
        return [p for item in items for p in pages(item)]

    nav = pages(config["nav"])
    on_disk = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert sorted(set(nav)) == on_disk and len(nav) == len(set(nav))


def test_the_readme_is_a_front_page_whose_test_commands_ci_runs():
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    for command in (".venv/bin/python -m pytest -q", ".venv/bin/python -m pytest -q --all"):
        assert re.search(rf"^{re.escape(command)}(\s|$)", text, re.M), command
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^\.venv/bin/python -m pytest -q --all\s*$", ci, re.M)
    assert "mkdocs build --strict" in ci


CITED_TEST = re.compile(r"\b((?:unit|integration)/(?:\w+/)?test_\w+\.py)")
# files the docs may cite although CI does not run them, each with its reason
BENCHMARK_ONLY = {"integration/test_mlproject_env.py": "`mlflow run` builds its own environment from the registry"}


def _ci_runs_a_test_of(path: Path) -> bool:
    """Whether `pytest --all` (CI's `not benchmark`) selects at least one test of ``path``: a module marked
    benchmark selects none; otherwise one test function without the marker (or a parametrisation without it)."""
    import ast

    tree = ast.parse(path.read_text())
    marked = lambda decorators: any("benchmark" in ast.unparse(d) and "param(" not in ast.unparse(d)  # noqa: E731
                                    for d in decorators)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets):
            if "benchmark" in ast.unparse(node.value):
                return False
    return any(isinstance(n, ast.FunctionDef) and n.name.startswith("test") and not marked(n.decorator_list)
               for n in tree.body)


def test_every_test_file_the_docs_cite_is_one_ci_runs():
    cited = {m for source in SOURCES for m in CITED_TEST.findall(source.read_text())}
    assert cited, "the docs cite no test file: the pattern is wrong"
    missing = sorted(c for c in cited if not (ROOT / "tests" / c).is_file())
    assert not missing, f"the docs cite test files that do not exist: {missing}"
    skipped = sorted(c for c in cited - set(BENCHMARK_ONLY) if not _ci_runs_a_test_of(ROOT / "tests" / c))
    assert not skipped, f"the docs cite test files CI never runs (all marked benchmark): {skipped}"
    assert not _ci_runs_a_test_of(ROOT / "tests" / "integration" / "test_generations.py")  # the check can say no


def test_the_environment_table_in_the_cli_reference_is_the_declared_one():
    from draftline.environment import markdown_table

    assert markdown_table() in (DOCS / "cli.md").read_text(), "regenerate it: python -m draftline.environment"


def test_no_module_reads_a_draftline_variable_but_through_its_declaration():
    """Every DRAFTLINE_* variable is read through draftline.environment, typed, where its default is said once."""
    src = ROOT / "src" / "draftline"
    direct = re.compile(r"""(environ(\.get)?[\[(]|getenv\()\s*["']DRAFTLINE_""")
    readers = [str(p.relative_to(src)) for p in src.rglob("*.py") if direct.search(p.read_text())]
    assert readers == [], readers
