"""The design lives in docs/: module docstrings stay short, and every page is in the README's index.

A module's docstring says what it does, its contract and where the design is written down
(``The design, in full: docs/<room>.md``); an essay of 30 lines or more in a docstring is a page of
docs/ (issue 29, move 8: the 30-47-line essays went there). Every page of docs/ is linked from
README's design notes, so a reader of a clone finds it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: The longest module docstring allowed, in lines; a longer one is an essay for docs/.
MAX_DOCSTRING_LINES = 29


def docstring_lines(source: str) -> int:
    doc = ast.get_docstring(ast.parse(source), clean=False)
    return len(doc.splitlines()) if doc else 0


def test_the_counter_counts_a_docstrings_lines():
    # Guards the guard: the essays moved to docs/ had 31-39 lines and would be caught.
    essay = '"""One line.\n\n' + "more\n" * 30 + '"""\n\nx = 1\n'
    assert docstring_lines(essay) == 32 > MAX_DOCSTRING_LINES
    assert docstring_lines('"""Short."""\n') == 1
    assert docstring_lines("x = 1\n") == 0


@pytest.mark.parametrize("top", ["dsio", "dstrain"])
def test_module_docstrings_are_not_essays(top):
    long = {
        p.relative_to(ROOT).as_posix(): n
        for p in sorted((ROOT / top).rglob("*.py"))
        if (n := docstring_lines(p.read_text())) > MAX_DOCSTRING_LINES
    }
    assert long == {}, "move the design to a docs/ page and link it from the docstring"


def test_every_docs_page_is_in_the_readme_index():
    linked = set(re.findall(r"\]\((docs/[\w-]+\.md)\)", (ROOT / "README.md").read_text()))
    pages = {p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")}
    assert pages and pages <= linked, sorted(pages - linked)
