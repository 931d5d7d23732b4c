"""``python -m torch.distributed.run ARGS`` for the tests, with the launcher forked from the session's fork server.

`run` returns what ``subprocess.run([sys.executable, "-m", "torch.distributed.run", *args],
capture_output=True, text=True, ...)`` returns (a `subprocess.CompletedProcess` with the launcher's exit
status, stdout and stderr; `subprocess.TimeoutExpired` past ``timeout``, the launcher killed), and the
launch is the same one: torchrun's own ``main`` (torch.distributed.run, run as ``python -m`` runs it) in a
process of its own, with the caller's environment and working directory, starting every rank as a new
interpreter (``python -u SCRIPT``), whose output goes where the launcher's goes.

What differs is how the launcher process starts: forked from tests/_forkserver.py, which has imported
torch and torch.distributed.run already, instead of a new interpreter importing them (~1.5-2.5 CPU-s and
2-5 s of wall a launch on this 2-core machine, paid before any rank starts). The ranks, whose start-up,
work and exit the tests judge, are untouched. ``DSTRAIN_TESTS_SPAWN_ONLY=1`` (as for the forked ranks)
launches a new interpreter instead.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import _forkserver

__all__ = ["run"]


def _launcher(args: list[str], cwd: str, env: dict[str, str], out: str, err: str) -> None:
    """In the forked process: become ``python -m torch.distributed.run ARGS`` run in ``cwd`` with ``env``."""
    os.environ.clear()  # the caller's environment (a forked process has the server's, from its start)
    os.environ.update(env)
    tempfile.tempdir = None  # TMPDIR read again (torchrun's torchelastic_* folders go there)
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):  # the launcher's and, inherited, every rank's output
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.argv = [sys.argv[0], *args]
    from torch.distributed.run import main

    try:
        main(args)  # raises as `python -m` would have it: SystemExit's code, or 1 with the traceback
    finally:
        atexit._run_exitfuncs()  # what the interpreter runs at exit (multiprocessing leaves with os._exit)
        sys.stdout.flush()
        sys.stderr.flush()


def _read(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except FileNotFoundError:
        return ""


def run(
    args: Sequence[str],
    *,
    cwd: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float,
) -> subprocess.CompletedProcess[str]:
    """``python -m torch.distributed.run *args`` in ``cwd`` with ``env`` (default: this process's)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", *args]
    env = dict(os.environ if env is None else env)
    cwd = os.fspath(cwd) if cwd is not None else os.getcwd()
    if os.environ.get("DSTRAIN_TESTS_SPAWN_ONLY") == "1":
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    # beside the launch's own temp files (tempfile's cached directory may be an earlier test's TMPDIR, gone)
    with tempfile.TemporaryDirectory(prefix="torchrun-output-", dir=env.get("TMPDIR") or None) as d:
        out, err = os.path.join(d, "stdout"), os.path.join(d, "stderr")
        p = _forkserver.context().Process(target=_launcher, args=(list(args), cwd, env, out, err))
        p.start()
        p.join(timeout)
        if p.exitcode is None:
            p.kill()
            p.join()
            raise subprocess.TimeoutExpired(cmd, timeout, output=_read(out), stderr=_read(err))
        return subprocess.CompletedProcess(cmd, p.exitcode, _read(out), _read(err))
