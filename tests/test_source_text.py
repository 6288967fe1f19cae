"""Code, tests and docs say what and why, not where a change came from: no issue numbers ("issue #57", "#55: ...",
"(issue: distributed serving)"). The records in benchmarks/results/ keep their history."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("reasoning_engine", "tests", "docs", "benchmarks", "scripts", "README.md")
SUFFIXES = {".py", ".md", ".sh", ".jinja", ".html", ".js", ".toml"}
ISSUE_REFERENCE = re.compile(r"\bissues? #?\d+|\(issue[:)]|\bissue: |(?:^|[\s(\[\"'])#\d{1,4}\b")


def issue_references(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if ISSUE_REFERENCE.search(line)]


def test_no_issue_numbers_in_code_tests_or_docs() -> None:
    found = []
    for name in SOURCES:
        path = ROOT / name
        for file in [path] if path.is_file() else sorted(path.rglob("*")):
            if file.suffix in SUFFIXES and "results" not in file.relative_to(ROOT).parts and file.resolve() != Path(__file__).resolve():
                found += [f"{file.relative_to(ROOT)}: {line}" for line in issue_references(file.read_text())]
    assert found == []


def test_the_pattern_finds_issue_numbers_and_nothing_else() -> None:
    assert issue_references('"""KV cache groups (issue #57): one pool."""\n') != []
    assert issue_references('    """#55: a forced call\'s strings took any marker."""') != []
    assert issue_references("(issue: distributed serving)") != []
    assert issue_references("spilled 32 KB before issue 30") != []
    assert issue_references('seq_id = f"{request_id}#0"; colour = "#ff0000"; html = "&#39;"') == []
    assert issue_references("the issue rate: 4 warp-instructions per SM per cycle, issue-bound fractions") == []
