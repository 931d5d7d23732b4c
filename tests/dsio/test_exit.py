"""Objects left open at exit never hang the process, and what they were asked to write lands.

Each scenario of ``_exit_scenarios.py`` runs in its own interpreter (all in parallel), creates a
dsio object, uses it (async writes still pending, a background checkpoint save running, an
exporter serving), and ends without closing it. The child must exit with status 0 within
``EXIT_S`` of finishing its body, and every byte it started writing must be on disk.

"Within EXIT_S" is measured beyond the exit time of a control interpreter that imports the same
modules and uses nothing, started and ended at the same moment: on a loaded 2-core machine
torch's own teardown alone can take longer than 10 s (measured 18 s for six at once), which
says nothing about dsio. A hang (today's: forever; a drain stuck on its 60 s bound) still fails.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time

import pytest
from _exit_scenarios import SCENARIOS, _data

EXIT_S = 10.0
HERE = os.path.dirname(os.path.abspath(__file__))


def _run_all(tmp_path) -> dict[str, tuple[int, float, str, str]]:
    procs = {}
    for name in SCENARIOS:
        d = tmp_path / name
        d.mkdir()
        procs[name] = (
            subprocess.Popen(
                [sys.executable, os.path.join(HERE, "_exit_scenarios.py"), name, str(d)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            ),
            str(d),
        )
    # A body that hangs (before READY) is killed by this watchdog rather than hanging the suite.
    watchdog = threading.Timer(300, lambda: [p.kill() for p, _d in procs.values()])
    watchdog.start()
    try:
        ready = {name: p.stdout.readline().startswith("READY") for name, (p, _d) in procs.items()}
    finally:
        watchdog.cancel()
    for p, _d in procs.values():
        if p.poll() is None:
            p.stdin.write("go\n")
            p.stdin.flush()
    t0 = time.monotonic()
    exited: dict[str, float] = {}
    while len(exited) < len(procs) and time.monotonic() - t0 < 120:
        for name, (p, _d) in procs.items():
            if name not in exited and p.poll() is not None:
                exited[name] = time.monotonic() - t0
        time.sleep(0.05)
    out = {}
    for name, (p, d) in procs.items():
        if name not in exited:
            for q, _d in procs.values():
                q.kill()
            pytest.fail(f"{name}: the process did not exit within 120 s (hang at exit)")
        took = exited[name] if ready[name] else float("nan")
        out[name] = (p.returncode, took, p.stderr.read(), d)
    return out


def _assert_files_landed(d: str) -> int:
    n = 0
    for f in os.listdir(d):
        if f.startswith("expected_"):
            with open(os.path.join(d, f), "rb") as e, open(os.path.join(d, f[len("expected_") :]), "rb") as g:
                assert g.read() == e.read(), f"{f[len('expected_') :]} does not hold what was written"
            n += 1
    return n


def test_objects_left_open_exit_promptly_and_flush(tmp_path):
    results = _run_all(tmp_path)
    base = results["control"][1]
    for name, (rc, took, err, _d) in results.items():
        assert rc == 0, f"{name}: exit status {rc}\n{err}"
        assert took < base + EXIT_S, f"{name}: exit took {took:.1f} s (control: {base:.1f} s)"
        assert "Traceback" not in err, f"{name}: {err}"
    expected_files = {"compat_open": 3, "compat_del": 4, "handle_bridge": 2, "handle_asyncio": 2}
    for name, n in expected_files.items():
        assert _assert_files_landed(results[name][3]) == n, name

    # The background save left running at exit was committed, and holds its data.
    from dsio.checkpoint import load

    ck = os.path.join(results["checkpointer"][3], "ck")
    assert sorted(os.listdir(ck)) == ["latest", "step-000000001", "step-000000002", "writer.lock"]
    with open(os.path.join(ck, "latest")) as f:
        assert int(f.read().strip().rsplit("-", 1)[-1]) == 2
    state = asyncio.run(load(os.path.join(ck, "step-000000002", "rank-00000.safetensors")))
    assert bool((state["x"] == _data(4 << 20, 2)).all())
