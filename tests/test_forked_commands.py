"""Commands run in a process forked from the session's fork server (tests/_forkserver.py `run`) instead of a
new interpreter give what the interpreter gives: a script (`_forkserver.script`) its ``__main__``, argv,
sys.path, environment, working directory, exit status (a crash's signal too), stdout and stderr apart;
torchrun (tests/_torchrun.py) the same launch as ``python -m torch.distributed.run`` (ranks that are new
interpreters); and they are forked (what they are for)."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import _forkserver
import _torchrun
import pytest

RANK = textwrap.dedent(
    """
    import os, sys, tempfile
    rank = os.environ["RANK"]
    with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
        launcher = f.read().replace(b"\\0", b" ").decode()
    def say(fd, line):  # one write a line: the two ranks share the launcher's output
        os.write(fd, (line + "\\n").encode())
    say(1, f"rank {rank} of {os.environ['WORLD_SIZE']} probe={os.environ.get('TORCHRUN_PROBE')} "
           f"cwd={os.getcwd()} tmp={tempfile.gettempdir()} torch_loaded={'torch' in sys.modules}")
    say(1, f"rank {rank} launcher: {launcher}")
    say(2, f"rank {rank} to stderr")
    # rank 1 fails only once rank 0 has said everything: torchrun ends the other ranks when one fails,
    # and a loaded machine may not have run rank 0's writes yet (its lines were missing once)
    done = os.path.join(os.getcwd(), "rank0-said")
    if rank == "0":
        open(done, "w").close()
    else:
        import time
        t = time.monotonic()
        while not os.path.exists(done) and time.monotonic() - t < 60:
            time.sleep(0.01)
    sys.exit(int(os.environ.get("TORCHRUN_PROBE_EXIT", "0")) if rank == "1" else 0)
    """
)


def _launch(
    d: Path, exit_code: int, spawn_only: bool, mp: pytest.MonkeyPatch
) -> subprocess.CompletedProcess[str]:
    """``rank.py`` on 2 ranks in ``d``: forked launcher, or (``spawn_only``) ``python -m torch.distributed.run``."""
    d.mkdir()
    (d / "rank.py").write_text(RANK)
    (d / "child-tmp").mkdir()
    if spawn_only:
        mp.setenv("DSTRAIN_TESTS_SPAWN_ONLY", "1")
    else:
        mp.delenv("DSTRAIN_TESTS_SPAWN_ONLY", raising=False)
    env = dict(os.environ, TORCHRUN_PROBE="from the caller", TORCHRUN_PROBE_EXIT=str(exit_code))
    env["TMPDIR"] = str(d / "child-tmp")
    return _torchrun.run(["--standalone", "--nproc_per_node", "2", "rank.py"], cwd=d, env=env, timeout=120)


def _rank_lines(out: str) -> list[str]:
    return sorted(line for line in out.splitlines() if line.startswith("rank ") and "launcher:" not in line)


def test_the_forked_launcher_launches_as_python_m_torch_distributed_run_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1 exits 3: both launches fail alike (status 1, torchrun's ChildFailedError naming exit code 3)."""
    forked = _launch(tmp_path / "forked", 3, False, monkeypatch)
    plain = _launch(tmp_path / "plain", 3, True, monkeypatch)
    assert forked.returncode == plain.returncode == 1, (forked.returncode, plain.returncode)
    for r, d in ((forked, tmp_path / "forked"), (plain, tmp_path / "plain")):
        assert _rank_lines(r.stdout) == [
            f"rank {i} of 2 probe=from the caller cwd={d} tmp={d / 'child-tmp'} torch_loaded=False"
            for i in (0, 1)
        ], r.stdout[-3000:]
        assert sorted(x for x in r.stderr.splitlines() if x.startswith("rank ")) == [
            "rank 0 to stderr",
            "rank 1 to stderr",
        ]
        assert "to stderr" not in r.stdout
        assert "ChildFailedError" in r.stderr and "exitcode  : 3" in r.stderr, r.stderr[-3000:]
    # what it is for: the launcher is a fork of the session's fork server, not a new interpreter
    launchers = {
        p: [x for x in r.stdout.splitlines() if "launcher:" in x] for p, r in (("f", forked), ("p", plain))
    }
    assert len(launchers["f"]) == len(launchers["p"]) == 2
    assert all("multiprocessing.forkserver" in x for x in launchers["f"]), launchers
    assert all("-m torch.distributed.run" in x for x in launchers["p"]), launchers


@pytest.mark.usefixtures("child_tmpdir")  # the launcher killed: its torchelastic_* folder stays with tmp_path
def test_a_launch_past_its_timeout_is_killed_and_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DSTRAIN_TESTS_SPAWN_ONLY", raising=False)
    (tmp_path / "rank.py").write_text(
        "import os, time\n"
        "deadline = time.monotonic() + 60\n"
        "while not os.path.exists('release') and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n"
    )
    t0 = time.monotonic()
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            _torchrun.run(["--standalone", "--nproc_per_node", "1", "rank.py"], cwd=tmp_path, timeout=3)
        assert time.monotonic() - t0 < 30
    finally:
        (tmp_path / "release").touch()  # the orphaned rank leaves too


SCRIPT = textwrap.dedent(
    """
    import os, sys
    import helper_mod  # from the PYTHONPATH entry the caller names
    # torch's threads from OMP_NUM_THREADS (the crash case leaves torch out: a new interpreter's import of it
    # is ~2 CPU-s)
    threads = __import__("torch").get_num_threads() if sys.argv[1] == "exit" else 1
    print(f"name={__name__} argv={sys.argv[1:]} path0={sys.path[0]} helper={helper_mod.VALUE} "
          f"cwd={os.getcwd()} probe={os.environ.get('FORKED_PROBE')} threads={threads}")
    print("to stderr", file=sys.stderr)
    with open(f"/proc/{os.getpid()}/cmdline", "rb") as f:
        print("cmdline:", f.read().replace(b"\\0", b" ").decode())
    if sys.argv[1] == "crash":
        import ctypes
        sys.stdout.flush()  # a pipe's stdout is block-buffered (without PYTHONUNBUFFERED): a crash loses it
        ctypes.string_at(0)  # SIGSEGV
    sys.exit(5)
    """
)


def _script(d: Path, how: str, forked: bool, mp: pytest.MonkeyPatch) -> subprocess.CompletedProcess[str]:
    d.mkdir()
    (d / "s.py").write_text(SCRIPT)
    (d / "lib").mkdir()
    (d / "lib" / "helper_mod.py").write_text("VALUE = 42\n")
    env = dict(os.environ, FORKED_PROBE="from the caller", OMP_NUM_THREADS="1", PYTHONPATH=str(d / "lib"))
    cmd = [sys.executable, str(d / "s.py"), how]
    if forked:
        mp.delenv("DSTRAIN_TESTS_SPAWN_ONLY", raising=False)
    else:
        mp.setenv("DSTRAIN_TESTS_SPAWN_ONLY", "1")
    call = functools.partial(_forkserver.script, str(d / "s.py"), [how], [str(d / "lib")])
    return _forkserver.run(call, cmd, cwd=d, env=env, timeout=120)


def test_a_forked_script_runs_as_a_new_interpreter_runs_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for how in ("exit", "crash"):
        forked = _script(tmp_path / f"forked-{how}", how, True, monkeypatch)
        plain = _script(tmp_path / f"plain-{how}", how, False, monkeypatch)
        assert forked.returncode == plain.returncode == (5 if how == "exit" else -signal.SIGSEGV), (
            forked.returncode,
            plain.returncode,
            forked.stderr[-2000:],
        )
        for r, d in ((forked, tmp_path / f"forked-{how}"), (plain, tmp_path / f"plain-{how}")):
            assert (
                f"name=__main__ argv=['{how}'] path0={d} helper=42 cwd={d} probe=from the caller threads=1"
                in (r.stdout)
            ), r.stdout + r.stderr[-2000:]
            assert "to stderr" in r.stderr and "to stderr" not in r.stdout
        cmdlines = [x for r in (forked, plain) for x in r.stdout.splitlines() if x.startswith("cmdline:")]
        assert "multiprocessing.forkserver" in cmdlines[0] and "s.py" in cmdlines[1], cmdlines


MODULE = textwrap.dedent(
    """
    import os, sys
    print(f"name={__name__} argv={sys.argv} path0={sys.path[0]} cwd={os.getcwd()} "
          f"probe={os.environ.get('FORKED_PROBE')}")
    sys.exit(7)
    """
)


def test_a_forked_module_runs_as_python_m_runs_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`_forkserver.module`: ``python -m NAME ARGS`` (tests/test_collection.py runs pytest so)."""
    results = []
    for forked in (True, False):
        d = tmp_path / ("forked" if forked else "plain")
        d.mkdir()
        (d / "probe_mod.py").write_text(MODULE)
        if forked:
            monkeypatch.delenv("DSTRAIN_TESTS_SPAWN_ONLY", raising=False)
        else:
            monkeypatch.setenv("DSTRAIN_TESTS_SPAWN_ONLY", "1")
        env = dict(os.environ, FORKED_PROBE="from the caller")
        call = functools.partial(_forkserver.module, "probe_mod", ["a", "b"])
        r = _forkserver.run(call, [sys.executable, "-m", "probe_mod", "a", "b"], cwd=d, env=env, timeout=120)
        assert r.returncode == 7, (forked, r.stderr[-2000:])
        results.append(r.stdout.strip())
        assert results[-1] == (
            f"name=__main__ argv={[str(d / 'probe_mod.py'), 'a', 'b']} path0={d} cwd={d} probe=from the caller"
        ), r.stdout + r.stderr[-2000:]


CODE = textwrap.dedent(
    """
    import os, sys, time
    print("to stderr", file=sys.stderr, flush=True)  # before the line the caller waits for
    print(f"name={__name__} argv={sys.argv} path0={sys.path[0]!r} cwd={os.getcwd()} "
          f"probe={os.environ.get('FORKED_PROBE')}", flush=True)
    if sys.argv[1] == "wait":
        time.sleep(120)  # killed here
    sys.exit(4)
    """
)


def test_a_forked_popen_reads_and_is_killed_as_a_popen_of_python_c(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`_forkserver.popen` + `_forkserver.code` (tests/dstrain/offload/_offload_helpers.kill_at): its
    stdout is read while it runs; SIGKILLed it ends -SIGKILL; left alone, its stdout ends and its status
    is its exit code; stderr apart. Both as ``subprocess.Popen([python, "-c", CODE, ...])``."""
    for forked in (True, False):
        if forked:
            monkeypatch.delenv("DSTRAIN_TESTS_SPAWN_ONLY", raising=False)
        else:
            monkeypatch.setenv("DSTRAIN_TESTS_SPAWN_ONLY", "1")
        env = dict(os.environ, FORKED_PROBE="from the caller")
        for how in ("wait", "exit"):
            call = functools.partial(_forkserver.code, CODE, [how])
            child = _forkserver.popen(call, [sys.executable, "-c", CODE, how], cwd=tmp_path, env=env)
            try:
                first = child.stdout.readline().strip()
                assert first == (
                    f"name=__main__ argv={['-c', how]} path0='' cwd={tmp_path} probe=from the caller"
                ), (forked, first, child.stderr())
                if how == "wait":
                    assert child.poll() is None
                    child.send_signal(signal.SIGKILL)
                    assert child.wait(timeout=60) == -signal.SIGKILL
                else:
                    assert child.stdout.read() == ""  # end of file: it has ended
                    assert child.wait(timeout=60) == 4
                assert child.returncode is not None and child.returncode == child.poll()
                assert child.stderr().strip() == "to stderr", (forked, child.stderr())
            finally:
                child.close()
