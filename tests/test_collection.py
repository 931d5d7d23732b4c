"""Any subset of the tests, and any single node id, collects and runs from any directory.

Shared helpers live in modules with names of their own (tests/_dsio_helpers.py,
tests/dstrain/_dstrain_helpers.py, ...). A module named ``conftest`` is ambiguous: pytest imports
tests/conftest.py and tests/dstrain/conftest.py under that one name, so ``from conftest import x``
got whichever was imported last (the child pytest that a ``needs_mount`` test starts under
``unshare -Urm`` for one node id failed that way, and so did ``pytest tests/dsio tests/dstrain``).
"""

from __future__ import annotations

import ast
import functools
import os
import subprocess
import sys
from pathlib import Path

import _forkserver
import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def _fresh_pytest(args: list[str]) -> None:
    """``python -m pytest ARGS`` in a forked child, every module loaded from tests/ forgotten first (this
    one and _forkserver came with the call): what this file tests is how pytest finds and imports them,
    and a module already in sys.modules would be found there instead."""
    run = _forkserver.module
    for name, mod in list(sys.modules.items()):
        if str(getattr(mod, "__file__", None) or "").startswith(str(TESTS) + os.sep):
            del sys.modules[name]
    run("pytest", args)


def _pytest(*args: str, cwd: str) -> subprocess.CompletedProcess[str]:
    """A pytest session of its own: forked from the fork server (torch, dsio, dstrain and pytest imported,
    no test module), as ``python -m pytest`` would run it (tests/test_forked_commands.py)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    argv = ["-p", "no:cacheprovider", *args]
    return _forkserver.run(
        functools.partial(_fresh_pytest, argv),
        [sys.executable, "-m", "pytest", *argv],
        cwd=cwd,
        env=env,
        timeout=300,
    )


def test_no_test_module_imports_a_conftest_by_name() -> None:
    offenders = []
    for path in TESTS.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            if any(n == "conftest" or n.startswith(("conftest.", "tests.")) for n in names):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []


@pytest.mark.usefixtures("child_tmpdir")  # the child session's own temp files go with tmp_path
def test_two_test_directories_collect_together(tmp_path: Path) -> None:
    """And ``--alone-list`` (tests/conftest.py) names the files of the `alone` tests among them, though
    -m deselects those: `make test`'s second run collects only what it lists."""
    listed = tmp_path / "alone.txt"
    args = [str(TESTS / "dsio"), str(TESTS / "dstrain"), str(TESTS / "test_loop_stall.py")]
    r = _pytest(
        "--collect-only", "-q", "-m", "not alone", "--alone-list", str(listed), *args, cwd=str(tmp_path)
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "tests collected" in r.stdout and "error" not in r.stdout.splitlines()[-1]
    assert "deselected" in r.stdout.splitlines()[-1]  # the `alone` tests were there, and -m left them out
    assert listed.read_text().splitlines() == ["tests/test_loop_stall.py"]


@pytest.mark.usefixtures("child_tmpdir")
def test_single_node_ids_from_both_directories_run_from_elsewhere(tmp_path: Path) -> None:
    """One dsio test that imports tests/_dsio_helpers.py and one dstrain test whose module imports the
    dstrain helpers, in one run started outside the checkout: both pass."""
    ids = [
        f"{TESTS}/dsio/test_roundtrip.py::test_zero_bytes_and_scalar[asyncio]",
        f"{TESTS}/dstrain/onebit/test_onebit_zeroone.py::test_schedule_without_communication_matches_deepspeed",
    ]
    r = _pytest("-q", *ids, cwd=str(tmp_path))
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "2 passed" in out, out[-4000:]
