"""docs/decisions.md stays a list of records: each entry (a heading and its text) at most 10 lines.

An entry says what was decided, why and what it costs; measurements and stories go to dated
files under bench/results/ (docs/decisions.md's first lines say so). Reads the file as text:
imports nothing from the product.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

DECISIONS = Path(__file__).resolve().parent.parent / "docs" / "decisions.md"
MAX_LINES = 10
MAX_WIDTH = 100  # so that 10 lines stay 10 lines' worth of text


def sections(text: str) -> list[tuple[str, list[str]]]:
    """Each heading with the non-blank lines under it, up to the next heading; the title's own
    lines (the rule and the contents) are not an entry."""
    found: list[tuple[str, list[str]]] = []
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if not fenced and line.startswith("#"):
            found.append((line, []))
        elif found and line.strip():
            found[-1][1].append(line)
    return [(heading, lines) for heading, lines in found if not heading.startswith("# ")]


def test_each_decision_is_at_most_ten_lines():
    long = [f"{heading} ({len(lines)} lines)" for heading, lines in sections(DECISIONS.read_text())
            if len(lines) > MAX_LINES]
    assert not long, f"entries over {MAX_LINES} lines; move measurements to bench/results/: {long}"


def test_entry_lines_are_wrapped():
    wide = [f"{heading}: {line[:40]}..." for heading, lines in sections(DECISIONS.read_text())
            for line in lines if len(line) > MAX_WIDTH]
    assert not wide, f"lines over {MAX_WIDTH} characters: {wide}"


def test_the_rule_is_stated_at_the_top_and_entries_live_under_headings():
    text = DECISIONS.read_text()
    assert any("at most 10 lines" in line for line in text.splitlines()[:5])
    top = text.split("\n## ", 1)[0].splitlines()[1:]  # the rule and the contents, no entries
    assert len([line for line in top if line.strip()]) <= 20


def test_sections_finds_entries_and_counts_their_lines():
    text = "# T\n\nrule\n\n## Topic\n\n### A\none\n\ntwo\n### B\n```\n# not a heading\n```\n"
    assert sections(text) == [("## Topic", []), ("### A", ["one", "two"]),
                              ("### B", ["```", "# not a heading", "```"])]
