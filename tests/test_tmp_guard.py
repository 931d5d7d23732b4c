"""The suite's temp-directory guard (tests/_tmp_guard.py): a session whose test, or a process the test
started, leaves something in the temp directory fails and names it and the test; a clean session
passes, and files another process puts in the machine's temp directory meanwhile are not counted."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

_CASES = textwrap.dedent(
    """
    import os, subprocess, sys, tempfile

    OUTER = os.environ["GUARD_OUTER"]

    def test_clean():
        with tempfile.TemporaryDirectory(prefix="clean-") as d:
            open(os.path.join(d, "f"), "w").close()

    def test_someone_else_on_the_machine():
        # another process writes straight into the machine's temp directory: not this session's
        open(os.path.join(OUTER, "not-ours"), "w").close()

    def test_leaks_a_dir():
        if os.environ.get("GUARD_LEAK") == "1":
            tempfile.mkdtemp(prefix="leaky-")

    def test_child_leaks_a_file():
        if os.environ.get("GUARD_LEAK") == "1":
            code = "import tempfile; tempfile.mkstemp(prefix='child-leak-')"
            subprocess.run([sys.executable, "-c", code], check=True)
    """
)


# serially, and under pytest-xdist as `make test` runs (two workers: the tests, and their leaks, on both)
WORKERS = [pytest.param([], id="serial"), pytest.param(["-n", "2"], id="xdist")]


def _session(tmp_path: Path, leak: bool, workers: list[str]) -> tuple[subprocess.CompletedProcess[str], Path]:
    outer = tmp_path / "outer"
    outer.mkdir()
    (tmp_path / "pytest-root").mkdir()  # PYTEST_DEBUG_TEMPROOT (an xdist controller makes its basetemp there)
    (tmp_path / "test_cases.py").write_text(_CASES)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = {
        **os.environ,
        "TMPDIR": str(outer),
        "GUARD_OUTER": str(outer),
        "GUARD_LEAK": "1" if leak else "0",
        "PYTHONPATH": str(TESTS),
        "PYTEST_DEBUG_TEMPROOT": str(tmp_path / "pytest-root"),
    }
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "_tmp_guard",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:randomly",
            *workers,
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return out, outer


@pytest.mark.parametrize("workers", WORKERS)
def test_a_clean_session_passes_and_its_directory_goes(tmp_path: Path, workers: list[str]) -> None:
    out, outer = _session(tmp_path, leak=False, workers=workers)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "4 passed" in out.stdout
    assert "temp files left behind" not in out.stdout
    # the session's directory is gone; what the other process wrote is left alone
    assert sorted(p.name for p in outer.iterdir() if not p.name.startswith("pymp-")) == ["not-ours"]


@pytest.mark.parametrize("workers", WORKERS)
def test_a_leak_fails_the_session_and_names_the_test(tmp_path: Path, workers: list[str]) -> None:
    out, outer = _session(tmp_path, leak=True, workers=workers)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "4 passed" in out.stdout  # the tests pass: the session fails
    section = out.stdout[out.stdout.index("temp files left behind") :]
    assert "leaky-" in section and "test_cases.py::test_leaks_a_dir" in section
    assert "child-leak-" in section and "test_cases.py::test_child_leaks_a_file" in section
    assert "not-ours" not in section
    # removed anyway: a leaking run does not fill the machine's temp directory
    assert sorted(p.name for p in outer.iterdir() if not p.name.startswith("pymp-")) == ["not-ours"]
