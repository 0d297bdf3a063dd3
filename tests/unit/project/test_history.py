"""History people can read: every commit since the rule (the first commit after 300f727) has a one-line subject
under 72 characters, the why in its body (STYLE.md; the repository's .githooks/commit-msg says so at commit
time)."""

import subprocess

import pytest

from ...conftest import ROOT

RULE_FROM = "300f727"  # the last commit before the rule


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def test_every_commit_since_the_rule_has_a_short_one_line_subject():
    try:
        _git("cat-file", "-e", f"{RULE_FROM}^{{commit}}")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip(f"no git history back to {RULE_FROM} here (a shallow clone or an archive)")
    log = _git("log", "--format=%h%x00%B%x01", f"{RULE_FROM}..HEAD")
    long = []
    for entry in filter(str.strip, log.split("\x01")):
        sha, message = entry.strip().split("\x00", 1)
        lines = message.splitlines()
        if len(lines[0]) > 72 or (len(lines) > 1 and lines[1].strip()):
            long.append(f"{sha} ({len(lines[0])} characters): {lines[0][:60]}")
    assert not long, "commit subjects over 72 characters or without a blank line after them: " + "; ".join(long)


def test_the_commit_msg_hook_refuses_a_long_subject(tmp_path):
    hook = ROOT / ".githooks" / "commit-msg"
    short, long, glued = (tmp_path / n for n in ("short", "long", "glued"))
    short.write_text("Plan each phase of the real run\n\nWhy it matters.\n")
    long.write_text("x" * 73 + "\n")
    glued.write_text("A subject\nand a body glued to it\n")
    assert subprocess.run([hook, short]).returncode == 0
    for bad in (long, glued):
        r = subprocess.run([hook, bad], capture_output=True, text=True)
        assert r.returncode == 1 and "commit-msg:" in r.stderr
