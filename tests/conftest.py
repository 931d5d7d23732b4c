"""Shared fixtures: real files on this machine's disk, both event loops, every backend it has.

Fixtures and hooks only: helpers that tests import live in tests/_dsio_helpers.py (a module named
``conftest`` is ambiguous once two directories have one).
"""

from __future__ import annotations

import asyncio
import gc
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _mount  # noqa: E402  (tests/_mount.py: mounts for the disk-full and no-O_DIRECT tests)
from _dsio_helpers import backend_params  # noqa: E402  (shared helpers: tests/_dsio_helpers.py)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--alone-list",
        metavar="PATH",
        help="write the files that hold `alone` tests to PATH, one a line, whatever -m selects (`make test`'s "
        "second run, -m alone, then collects only those instead of the whole suite again)",
    )


# a second pytest_collection_modifyitems (pytest registers a conftest's pytest_* names only), run first:
# before -m deselects the `alone` tests
@pytest.hookimpl(tryfirst=True, specname="pytest_collection_modifyitems")
def pytest_list_alone_files(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``--alone-list PATH``: the files of this collection's `alone` tests to PATH (on xdist, by each
    worker: each collects every file; written whole, then renamed, so either worker's copy is whole)."""
    path = config.getoption("alone_list")
    if not path:
        return
    files = set()
    for item in items:
        if item.get_closest_marker("alone") is not None:
            try:
                files.add(item.path.relative_to(config.rootpath).as_posix())
            except ValueError:  # outside the checkout
                files.add(str(item.path))
    tmp = f"{path}.{os.getpid()}"
    Path(tmp).write_text("".join(f"{f}\n" for f in sorted(files)))
    os.replace(tmp, path)


def pytest_configure(config: pytest.Config) -> None:
    if not config.pluginmanager.has_plugin("_tmp_guard"):  # the session's temp directory, checked at the end
        config.pluginmanager.import_plugin("_tmp_guard")
    config.addinivalue_line(
        "markers",
        "needs_mount: mounts a small filesystem (root: directly; else re-run under `unshare -Urm`, tests/_mount.py)",
    )


def pytest_collection_finish(session: pytest.Session) -> None:
    """Everything imported and built by the collection (torch, dsio, dstrain, every test module: ~200k
    objects) moves to the cyclic GC's permanent generation: each full collection during the tests skips
    it instead of walking it (~0.1 s each; measured on 4 dsio files, 210 tests: 22 full collections,
    2.32 -> 0.21 CPU-s). Frozen objects are never collected: they live as long as the session anyway."""
    gc.freeze()


def _reroutes(item: pytest.Item) -> bool:
    return item.get_closest_marker("needs_mount") is not None and not _mount.can_mount_directly()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    _mount.deferred = _reroutes(item)  # the mount fixtures only make their folders here
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    yield
    _mount.deferred = False


# the child runs of rerouted tests, by scope (one per session; per file on an xdist worker): results, output
_NAMESPACE_RUN: dict[str, dict[str, Any]] = {}


def _reroute_scope(item: pytest.Item) -> str:
    """The tests one ``unshare -Urm`` child runs: the session's; on an xdist worker, which gets whole
    files (``--dist loadfile``), the file's (a worker's session lists every test, not just its own)."""
    return item.path.as_posix() if hasattr(item.config, "workerinput") else ""


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """A ``needs_mount`` test run by a user who cannot mount runs in a child under ``unshare -Urm``; the
    first such test runs all of its scope's in one child (one interpreter start), the rest read back."""
    if not _reroutes(pyfuncitem):
        return None
    _mount.require_namespace()
    scope = _reroute_scope(pyfuncitem)
    run = _NAMESPACE_RUN.setdefault(scope, {})
    if "results" not in run:
        ids = [i.nodeid for i in pyfuncitem.session.items if _reroutes(i) and _reroute_scope(i) == scope]
        base = Path(tempfile.mkdtemp(prefix="dsio-mountns-"))
        run["base"] = base
        try:
            run["results"], run["output"] = _mount.run_in_namespace(ids, base)
        except BaseException:
            run.setdefault("results", {})
            run.setdefault("output", "")
            raise
    _mount.mirror(pyfuncitem.nodeid, run["results"], run["output"])
    return True


def pytest_sessionfinish(session: pytest.Session) -> None:
    for run in _NAMESPACE_RUN.values():
        if "base" in run:
            shutil.rmtree(run["base"], ignore_errors=True)


# Directories whose test files share one computation across modules (not a module fixture, which
# --dist loadfile keeps on one worker): each goes to one xdist worker whole, or every worker that got
# one of its files would compute it again.
_ONE_WORKER_DIRS = (
    "tests/dstrain/onebit/",  # _onebit_workers.shared_runs: ONE 2-rank group runs every module's workers
)


# The longest files, handed out first so that no worker is left alone with one at the end (xdist's own
# order is by number of tests, which puts test_demo's single ~40 s test last). Longest first, by their
# seconds in a whole `make test` on 2 workers (2026-12-01 20:15, load 4.1 -> 1.3, 919037a, in
# bench/results/suite-time-2026-12-01-s8.md; both workers ended within 1 s of each other; since then
# test_dist_timeout no longer sleeps 8 s twice, and test_exit_teardown's launchers fork: ~30% shorter); the
# order only balances the workers: a file missing here, or one no longer long, costs balance, never a result.
_LONG_FILES = (
    "tests/dstrain/dist/test_exit_teardown.py",
    "tests/dstrain/onebit/",
    "tests/test_demo.py",
    "tests/test_readme_blocks.py",
    "tests/dstrain/zero/test_zero_init_memory.py",
    "tests/test_collection.py",
    "tests/dstrain/zero/test_zero_parity.py",
    "tests/test_forked_commands.py",  # (new since that run: ~20 s under load)
    "tests/bench/test_offload_gpu_bench.py",
    "tests/dstrain/integrations/test_hf_trainer.py",
    "tests/dsio/test_read_path.py",
    "tests/dstrain/checkpoint/test_checkpoint_reshape.py",
    "tests/dsio/test_roundtrip.py",
    "tests/dsio/test_cli.py",
    "tests/bench/test_activation_checkpointing_bench.py",
    "tests/dsio/test_concurrency.py",
)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under ``--dist loadfile`` (`make test`): whole files to a worker, each of `_ONE_WORKER_DIRS` as one,
    in the workers' collection order (`_LONG_FILES` first)."""
    if config.getvalue("dist") != "loadfile":
        return None  # xdist's own scheduler for the mode asked for
    from xdist.scheduler import LoadFileScheduling

    class _Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return next((d for d in _ONE_WORKER_DIRS if nodeid.startswith(d)), None) or super()._split_scope(
                nodeid
            )

    config.option.loadscopereorder = False  # the workers' order (below); xdist's sorts by number of tests
    return _Scheduling(config, log)


_LONG_FIRST = "dsio_long_files_first"  # workerinput: the controller schedules with _Scheduling above


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:  # xdist controller, before it starts a worker
    node.workerinput[_LONG_FIRST] = node.config.getvalue("dist") == "loadfile"  # a worker's "dist" is "no"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On an xdist worker under ``--dist loadfile``: `_LONG_FILES` first (the controller hands the files
    out in the order its workers collected them). A stable sort by file: a file's tests stay together
    and in order; every worker sorts alike, as the controller requires."""
    if getattr(config, "workerinput", {}).get(_LONG_FIRST):

        def rank(item: pytest.Item) -> int:
            return next((i for i, f in enumerate(_LONG_FILES) if item.nodeid.startswith(f)), len(_LONG_FILES))

        items.sort(key=rank)


def _uvloop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:  # uvloop is a dependency; without it the async tests still run on asyncio
        return None
    return uvloop.new_event_loop


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Any]:
    """Every ``async def`` test (pytest-asyncio, auto mode) runs twice: on asyncio's loop and on uvloop's.

    The ids say which: ``test_x[asyncio]``, ``test_x[uvloop]``."""
    factories: dict[str, Any] = {"asyncio": asyncio.new_event_loop}
    uv = _uvloop_factory()
    if uv is not None:
        factories["uvloop"] = uv
    return factories


@pytest.fixture
def many_fds() -> Iterator[int]:
    """Raise this process's soft open-file limit to 4096 (or the hard limit) for the test; restored after.

    1,000 concurrent operations on 1,000 distinct files hold ~1,000 descriptors at once, and a non-root
    shell's default soft limit is often 1024 (root's here: 20000). Skips (fails under DSIO_CI=1) saying so
    when the hard limit is below 2048. Yields the limit in force."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4096 if hard == resource.RLIM_INFINITY else min(hard, 4096)
    if want < 2048:
        _mount.skip_or_fail(f"needs ~1,100 open files; the hard limit (ulimit -Hn) is {hard}")
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    try:
        yield resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.fixture
def child_tmpdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``TMPDIR`` of the processes this test starts: a folder of its ``tmp_path``, so what a launcher
    never removes (torchrun's ``torchelastic_*`` log folders, its workers' ``pytorch-errorfile-*``)
    goes with the test's own files instead of the session's temp directory (tests/_tmp_guard.py)."""
    d = tmp_path / "child-tmp"
    d.mkdir()
    monkeypatch.setenv("TMPDIR", str(d))
    return d


@pytest.fixture(params=backend_params())
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def data_dir(tmp_path) -> str:
    """A directory on a real disk filesystem (O_DIRECT capable here: ext4)."""
    d = tmp_path / "data"
    d.mkdir()
    return str(d)
