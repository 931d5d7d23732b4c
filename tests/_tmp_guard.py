"""The test session's own temp directory: every test removes what it creates, and a leak fails the run.

At configure time the session makes one private directory (``dsio-tests-XXXX`` in the temp directory
it was started with) and points ``TMPDIR`` (and ``tempfile``) at it, so everything this session and
its children create with ``tempfile`` (rank workers, torchrun's ``torchelastic_*`` log directories and
``pytorch-errorfile-*`` files, ``mkdtemp`` in a test) lands there and nothing of another process on
the machine ever does (0700, a fresh name): what is left in it at the end is this session's leak, so
the check cannot flake on someone else's files. What the session keeps outside on purpose:

- pytest's ``tmp_path`` directories (``PYTEST_DEBUG_TEMPROOT``: where pytest keeps them, bounded by
  pytest's own retention), torch's compile cache (``TORCHINDUCTOR_CACHE_DIR``: a cache meant to
  outlive a run) and multiprocessing's directory of this process (made before the switch, removed by
  multiprocessing at exit).

A test's entries are attributed to the test that was running when they appeared (`note_test`). At
the end (`finish`), entries still there after a short grace (a child's atexit clean-up finishing)
fail the session with their names and tests; the directory is removed either way.

A pytest plugin (tests/conftest.py loads it; ``-p _tmp_guard`` loads it anywhere): the hooks at the
bottom call the functions above. Under pytest-xdist each worker is a session of its own (its own
directory beside the controller's, in the temp directory the controller was started with); a
worker's leaks travel to the controller (``workeroutput``), which fails the run and names them.
"""

from __future__ import annotations

import getpass
import multiprocessing.util
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

__all__ = ["finish", "note_test", "start"]


@dataclass
class _Session:
    base: str  # the session's directory
    outer: str  # the temp directory the session was started with
    seen: set[str] = field(default_factory=set)  # entries at the last look
    owner: dict[str, str] = field(default_factory=dict)  # entry -> the test it appeared during


_session: _Session | None = None


def start(outer: str | None = None) -> str:
    """Make the session's directory in ``outer`` (default: the temp directory now) and point ``TMPDIR``
    at it; returns it. Idempotent."""
    global _session
    if _session is not None:
        return _session.base
    if outer is not None:  # an xdist worker: started with its controller's TMPDIR, given the real one
        os.environ["TMPDIR"] = outer
        tempfile.tempdir = None
    outer = tempfile.gettempdir()
    multiprocessing.util.get_temp_dir()  # this process's pymp-* stays outside (multiprocessing removes it)
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", outer)
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (a container's arbitrary uid)
        user = str(os.getuid())
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(outer, f"torchinductor_{user}"))
    base = tempfile.mkdtemp(prefix="dsio-tests-", dir=outer)
    os.environ["TMPDIR"] = base
    tempfile.tempdir = None  # recomputed from TMPDIR on next use
    _session = _Session(base=base, outer=outer)
    return base


def _entries(base: str) -> set[str]:
    try:
        return set(os.listdir(base))
    except FileNotFoundError:
        return set()


def note_test(nodeid: str) -> None:
    """Attribute entries that appeared since the last call to ``nodeid`` (call after each test)."""
    if _session is None:
        return
    now = _entries(_session.base)
    for name in now - _session.seen:
        _session.owner.setdefault(name, nodeid)
    _session.seen = now


def finish(grace: float = 2.0) -> list[str]:
    """Lines naming each entry left in the session's directory (empty: none); removes the directory."""
    global _session
    if _session is None:
        return []
    s, _session = _session, None
    deadline = time.monotonic() + grace
    left = _entries(s.base)
    while left and time.monotonic() < deadline:
        time.sleep(0.25)
        left = _entries(s.base)
    lines = [
        f"{name}  (appeared during {s.owner.get(name, 'session set-up or teardown')})"
        for name in sorted(left)
    ]
    shutil.rmtree(s.base, ignore_errors=True)
    os.environ["TMPDIR"] = s.outer  # what runs after the session (atexit) has a temp directory
    tempfile.tempdir = None
    return lines


# -- the plugin -----------------------------------------------------------------------------------

_LEAKS: list[str] = []


_WORKER_KEY = "dsio_tmp_guard"  # workerinput: the controller's outer directory; workeroutput: leaks


def pytest_configure(config: pytest.Config) -> None:
    # before anything makes a temp file: TMPDIR is this session's directory
    workerinput = getattr(config, "workerinput", None)  # set by xdist on its workers only
    start(workerinput[_WORKER_KEY] if workerinput is not None and _WORKER_KEY in workerinput else None)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:  # xdist controller, before it starts a worker
    assert _session is not None
    node.workerinput[_WORKER_KEY] = _session.outer


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:  # xdist controller, a worker has finished
    _LEAKS.extend(getattr(node, "workeroutput", {}).get(_WORKER_KEY, []))


def pytest_runtest_logfinish(nodeid: str) -> None:
    note_test(nodeid)


@pytest.hookimpl(trylast=True)  # after the conftests' own clean-up at session end
def pytest_sessionfinish(session: pytest.Session) -> None:
    _LEAKS.extend(finish())
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: its controller reports them
        workeroutput[_WORKER_KEY] = list(_LEAKS)
    if _LEAKS and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _LEAKS:
        terminalreporter.section("temp files left behind", red=True, bold=True)
        terminalreporter.line(
            "FAILED: left in the session's temp directory (tests/_tmp_guard.py); use tmp_path, or "
            "remove what the test, or a process it started, created"
        )
        for line in _LEAKS:
            terminalreporter.line(f"  {line}")
