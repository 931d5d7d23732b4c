"""Every repository path named in the docs and in the code's comments exists.

Files move (``bench/experiments/``, the test rooms under ``tests/dstrain/<room>/``); a README, a docstring
or a C++ comment that names the old place sends a reader nowhere. This test reads the prose and the
comments of the checkout's files, finds each path that starts with one of the repository's top-level
folders, and checks that it names a file or folder of the repository.

A path counts as existing when it is a file or folder; a module written without ``.py``
(``dstrain/config_reference``); a module's attribute (``bench/_common.RESULTS``); or the stem of
result files (``bench/results/demo-2026-11-30`` for its ``.md``, ``.json`` and ``.png``). A name
followed by ``<`` is a pattern (``tests/dsio/test_<concept>.py``) and is not checked.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TOP = ("dsio", "dstrain", "bench", "tests", "csrc", "docs", "scripts", "examples", "grafana", "demo", ".ci")
PATH = re.compile(r"(?<![\w/.-])((?:" + "|".join(re.escape(t) for t in TOP) + r")/[\w./-]*[\w/])")

#: What is read: the docs, and the code whose comments and docstrings point readers at files.
DOCS = ("README.md", "docs/", "bench/results/README.md", "bench/experiments/README.md")
CODE = ("dsio/", "dstrain/", "bench/", "csrc/", "scripts/", "Makefile")
SKIPPED = ("bench/results/",)
SKIP_DIRS = {
    "build",
    "__pycache__",
    "node_modules",
}  # the result files themselves: records of their day, not pointers

#: (file, path) -> why the path is named although it is not in the tree.
NOT_IN_TREE = {
    ("docs/architecture.md", "dsio/_C"): "the native module, built from csrc/ (not tracked)",
    (
        "bench/experiments/README.md",
        "bench/io_staged_write_ab.py",
    ): "a deleted driver, named with its findings",
    ("bench/experiments/README.md", "bench/train_divergence.py"): "a deleted driver, named with its findings",
    (
        "bench/experiments/README.md",
        "bench/experiments/io_read_diag.py",
    ): "a deleted experiment, named with its findings",
    (
        "bench/results/README.md",
        "bench/experiments/io_read_diag.py",
    ): "the result's experiment of its day, since deleted (bench/experiments/README.md)",
    (
        "csrc/engine.hpp",
        "bench/experiments/io_read_diag.py",
    ): "the deleted experiment that read the timeline (tests/dsio/test_transfer_copier.py still does)",
    (
        "bench/results/README.md",
        "bench/io_tuned.py",
    ): "a result's driver of its day, since folded into bench/io.py",
}


def tracked() -> list[str]:
    """The checkout's files (relative, posix), without build outputs, caches and virtual environments
    (read from the tree, not from git: a clone owned by another user, or an export, works too)."""
    out = []
    for top, dirs, names in os.walk(ROOT):
        dirs[:] = [
            d
            for d in dirs
            if d not in SKIP_DIRS and not d.endswith(".egg-info") and (d == ".ci" or d[0] != ".")
        ]
        rel = Path(top).relative_to(ROOT)
        out += [(rel / n).as_posix() for n in names]
    return out


def named_paths(text: str) -> list[tuple[int, str]]:
    """(line, path) of every repository path named in ``text`` (patterns like ``test_<x>.py`` left out)."""
    found = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for m in PATH.finditer(line):
            if line[m.end() : m.end() + 1] == "<":
                continue
            found.append((lineno, m.group(1).rstrip("/.")))
    return found


def exists(path: str, files: set[str]) -> bool:
    if (ROOT / path).exists() or (ROOT / f"{path}.py").exists():
        return True
    module, _, attribute = path.rpartition(".")
    if attribute.isidentifier() and (ROOT / f"{module}.py").is_file():
        return True  # bench/_common.RESULTS
    return any(f.startswith((f"{path}.", f"{path}-")) for f in files)  # a stem of result files


def read_files(files: list[str]) -> list[str]:
    def wanted(f: str) -> bool:
        if f in DOCS or (f.startswith("docs/") and f.endswith(".md")):
            return True
        return (
            f.startswith(CODE) and not f.startswith(SKIPPED) and not f.endswith((".json", ".jsonl", ".png"))
        )

    return [f for f in files if wanted(f)]


def test_the_finder_finds_paths():
    # Guards the guard: a path in prose, in a comment and in backticks is found; a pattern is not.
    text = "see bench/io_read_diag.py --timeline\n// (csrc/engine.hpp) and `tests/dsio/test_<concept>.py`\n"
    assert named_paths(text) == [(1, "bench/io_read_diag.py"), (2, "csrc/engine.hpp")]
    files = set(tracked())
    assert not exists("bench/io_read_diag.py", files)  # moved to bench/experiments/
    assert exists("bench/experiments/io_version_ab.py", files)
    assert exists("bench/_common.RESULTS", files)


def test_every_named_path_exists():
    files = tracked()
    every = set(files)
    missing = {}
    for f in read_files(files):
        path = ROOT / f
        if not path.is_file():
            continue
        for line, named in named_paths(path.read_text(errors="replace")):
            if (f, named) not in NOT_IN_TREE and not exists(named, every):
                missing[f"{f}:{line}"] = named
    assert missing == {}, "fix the reference (the file moved?) or say in NOT_IN_TREE why it names a gone path"


def test_every_exemption_is_still_named():
    # NOT_IN_TREE cannot go stale into a blanket exemption
    named = {(f, p) for f, _ in NOT_IN_TREE for _, p in named_paths((ROOT / f).read_text())}
    assert set(NOT_IN_TREE) <= named, sorted(set(NOT_IN_TREE) - named)
