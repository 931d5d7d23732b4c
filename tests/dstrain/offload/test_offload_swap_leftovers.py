"""Swap directories of a killed run are removed when the next run with the same ``nvme_path``
starts; a live run's are never touched (a lock per run directory: dstrain/offload/swap/rundir.py)."""

from __future__ import annotations

import functools
import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import _forkserver

from dstrain.offload.swap import Swapper

HOLD = textwrap.dedent(
    """
    import sys, time
    from dstrain.offload.swap import Swapper

    s = Swapper(sys.argv[1], "optimizer", buffer_bytes=1 << 20, buffer_count=1)
    s.reserve("m", 1 << 20)
    print(s.path, flush=True)
    time.sleep(600)
    """
)


def _start_run(nvme: Path) -> tuple[_forkserver.Started, Path]:
    """A run holding its swap directory: a process of its own (forked from the fork server: tests/
    _forkserver.py, no new interpreter's imports), until killed."""
    cmd = [sys.executable, "-c", HOLD, str(nvme)]
    p = _forkserver.popen(functools.partial(_forkserver.code, HOLD, [str(nvme)]), cmd)
    line = p.stdout.readline().strip()
    assert line, f"the run printed no swap path; stderr:\n{p.stderr()[-3000:]}"
    return p, Path(line).parent


def _swap_dirs(nvme: Path) -> set[str]:
    return {n for n in os.listdir(nvme) if n.startswith("dstrain-swap-")}


def test_a_killed_runs_directory_goes_a_live_runs_stays(tmp_path: Path) -> None:
    killed, killed_dir = _start_run(tmp_path)
    live, live_dir = _start_run(tmp_path)
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait(30)
        assert killed_dir.is_dir()  # nobody cleaned up after kill -9
        s = Swapper(tmp_path, "param", buffer_bytes=1 << 20, buffer_count=1)  # the next run starts
        try:
            assert not killed_dir.exists()
            assert live_dir.is_dir() and (live_dir / "optimizer.swp").parent == live_dir
            assert _swap_dirs(tmp_path) == {live_dir.name, os.path.basename(os.path.dirname(s.path))}
        finally:
            s.close()
        assert _swap_dirs(tmp_path) == {live_dir.name}  # closing removes only its own
    finally:
        killed.close()
        live.close()  # kills it


def test_a_directory_without_a_lock_is_left_alone(tmp_path: Path) -> None:
    """A run that has just made its directory (or an older dstrain's) has no lock file yet."""
    other = tmp_path / "dstrain-swap-optimizer-older"
    other.mkdir()
    (other / "optimizer.swp").write_bytes(b"x")
    time.sleep(0.01)
    s = Swapper(tmp_path, "param", buffer_bytes=1 << 20, buffer_count=1)
    s.close()
    assert (other / "optimizer.swp").exists()
