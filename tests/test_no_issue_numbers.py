"""Docs, code, examples, benchmarks and tests speak to users, not to the project's tracker.

A reader cannot follow "issue 26" or "(issue 34 item 13)": the text should say what the
code does, why, or which defect a test guards against ("a stale index used to read the
old offsets here"). This test fails on any such citation in docs/, blox/, examples/,
benchmarks/, tests/ and README.md, naming each file, line and text.

What counts: "issue" or "issues" followed by a number ("issue 5", "Issue #17", "issues
22"), and the fragments that only make sense beside one: "(item 13)", "(items 1, 5)",
or a section comment "# -- item 15: ...". No allow-list: a link to an upstream
project's issue is written as its URL (``https://github.com/jax-ml/jax/issues/<n>``),
which these patterns do not match (the number follows "issues/", not a space or "#").
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("docs", "blox", "examples", "benchmarks", "tests", "README.md")
SUFFIXES = {".py", ".md", ".rst", ".txt", ".toml", ".cfg", ".ini", ".yml", ".yaml", ".sh",
            ".json", ".jsonl", ".ipynb"}  # fmt: skip
CITATION = re.compile(
    r"\bissues?\s*#?\s*\d+"  # issue 26, Issue #17, issues 22
    r"|\(\s*items?\s+\d+"  # (item 13), (items 1, 5)
    r"|#\s*-+\s*items?\s+\d+",  # # -- item 15: ...
    re.IGNORECASE,
)


def _files():
    for name in SCANNED:
        top = ROOT / name
        paths = [top] if top.is_file() else sorted(top.rglob("*"))
        for path in paths:
            if (
                path.is_file()
                and path.suffix in SUFFIXES
                and "__pycache__" not in path.parts
                and path.resolve() != Path(__file__).resolve()
            ):
                yield path


def test_the_scan_sees_the_tree():
    # a moved root or a renamed folder would make the real test pass on nothing
    names = {p.relative_to(ROOT).as_posix() for p in _files()}
    assert "README.md" in names
    assert "docs/sysid.md" in names
    assert "blox/__init__.py" in names
    assert any(n.startswith("examples/") for n in names)
    assert any(n.startswith("benchmarks/") for n in names)
    assert "tests/test_no_issue_numbers.py" not in names  # this file names the patterns


def test_the_pattern_catches_citations_and_spares_prose():
    for cited in (
        "see issue 26",
        "Issue #17:",
        "(issue 34 item 13)",
        "issues 22 and 23",
        "restored (item 20);",
        "(items 1, 5)",
        "# -- item 15: steps increase",
    ):
        assert CITATION.search(cited), cited
    for prose in (
        "pipeline reads item 0 once",
        "this issue: the carry",
        "issues/34755",
        "https://github.com/jax-ml/jax/issues/34755",
        "tissue 5",
    ):
        assert not CITATION.search(prose), prose


def test_no_file_cites_an_issue_number():
    hits = []
    for path in _files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            m = CITATION.search(line)
            if m:
                hits.append(f"{path.relative_to(ROOT).as_posix()}:{n}: {line.strip()[:120]}")
    assert not hits, (
        f"{len(hits)} line(s) cite the tracker; say what the code does, why, or which "
        "defect a test guards against instead:\n" + "\n".join(hits)
    )
