"""The one fork server of the test session: child processes that start in ~0.1 s instead of ~2-4 s.

A ``spawn`` child is a new interpreter that imports torch (~2 s of CPU on this 2-core machine, 4-8 s of
wall under load) before it does anything. multiprocessing's fork server imports the modules named here
once, in a clean single-purpose process started on first use (no pytest threads, no CUDA, no event
loops), and forks every later child from it: each child is still a new process with its own memory,
fresh RNG state and nothing of an earlier child's, but it skips the imports.

multiprocessing has ONE fork server per process and its preload list is fixed when the server starts,
so every user takes its context from here: whichever test starts the server first, the list is the same.
`run` runs a call (`script`: a Python script; `module`: ``python -m``; `code`: ``python -c``) in a process forked from it where a test would start an
interpreter for it, and returns what ``subprocess.run`` would (tests/_torchrun.py launches torchrun so); `popen` starts one
and returns at once, its stdout a stream to read while it runs (a test that kills it at a printed line).
What a forked child does NOT get from the caller (it is forked from the server, not from pytest): the
caller's current environment (the server's is the one at its start) and anything the C library reads
once at start-up (``MALLOC_*`` tunables, a cgroup charge for the imported pages). Callers that set
environment variables pass ``os.environ`` along and apply it in the child (``_dstrain_helpers.spawn``
does); a test whose subject is process start-up or memory accounting keeps ``spawn``.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import random
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import IO

__all__ = ["PRELOAD", "Started", "code", "context", "module", "popen", "run", "script"]

#: Imported by the fork server before it forks anything. A module that cannot be imported there is
#: skipped by multiprocessing (the child imports it itself, as a spawned one would).
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.multiprocessing",
    # imported by the first torch.optim.Optimizer a rank builds (its constructor is wrapped by
    # torch._disable_dynamo): ~1-2 s of CPU per rank, and sympy with it, when left to each child
    "torch._dynamo",
    # torchrun's launcher, forked by tests/_torchrun.py (a new interpreter importing it: ~1.5-2.5 CPU-s)
    "torch.distributed.run",
    "dsio",
    "dsio.checkpoint",
    "dstrain",
    "pytest",
    # test modules whose functions the children run (importable where their folder is on sys.path)
    "test_crash",
    "test_crash_points",
    "ckpt_dist_workers",
    "_dstrain_helpers",
    "_torchrun",
]


def context() -> BaseContext:
    """multiprocessing's fork-server context with this session's preload list."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _in_child(
    call: Callable[[], object], cwd: str, env: dict[str, str], out: str | Connection, err: str
) -> None:
    """In the forked process: ``call()`` in ``cwd`` with ``env``, stdout and stderr to ``out`` / ``err``
    (a file's path, or for stdout the writing end of a pipe)."""
    os.environ.clear()  # the caller's environment (a forked process has the server's, from its start)
    os.environ.update(env)
    tempfile.tempdir = None  # TMPDIR read again
    os.chdir(cwd)
    random.seed()  # a state of its own, as a new interpreter has (a fork copies the server's)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules and env.get("OMP_NUM_THREADS", "").isdigit():  # read by torch at its import
        sys.modules["torch"].set_num_threads(int(env["OMP_NUM_THREADS"]))
    for fd, target in ((1, out), (2, err)):  # this process's and, inherited, its children's output
        if isinstance(target, Connection):
            os.dup2(target.fileno(), fd)
            target.close()
            continue
        f = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    try:
        call()  # leaves as a script would: SystemExit's code, or 1 with the traceback
    finally:
        # what the interpreter does at exit (multiprocessing leaves with os._exit): join the non-daemon
        # threads (and run threading's exit hooks), then the atexit hooks
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()


def _read(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except FileNotFoundError:
        return ""


def run(
    call: Callable[[], object],
    cmd: Sequence[str],
    *,
    cwd: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float,
) -> subprocess.CompletedProcess[str]:
    """``call()`` in a process forked from the fork server, standing in for the interpreter command ``cmd``:
    what ``subprocess.run(cmd, capture_output=True, text=True, cwd=, env=, timeout=)`` returns (its exit
    status, stdout and stderr; `subprocess.TimeoutExpired` past ``timeout``, the process killed), without
    the new interpreter's imports. ``DSTRAIN_TESTS_SPAWN_ONLY=1`` runs ``cmd`` itself instead. For what
    is not about interpreter start-up (see the module's docstring)."""
    env = dict(os.environ if env is None else env)
    cwd = os.fspath(cwd) if cwd is not None else os.getcwd()
    if os.environ.get("DSTRAIN_TESTS_SPAWN_ONLY") == "1":
        return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    # beside the command's own temp files (tempfile's cached directory may be an earlier test's TMPDIR, gone)
    with tempfile.TemporaryDirectory(prefix="forked-output-", dir=env.get("TMPDIR") or None) as d:
        out, err = os.path.join(d, "stdout"), os.path.join(d, "stderr")
        p = context().Process(target=_in_child, args=(call, cwd, env, out, err))
        p.start()
        p.join(timeout)
        if p.exitcode is None:
            p.kill()
            p.join()
            raise subprocess.TimeoutExpired(list(cmd), timeout, output=_read(out), stderr=_read(err))
        return subprocess.CompletedProcess(list(cmd), p.exitcode, _read(out), _read(err))


def script(path: str, args: Sequence[str], paths: Sequence[str] = ()) -> None:
    """``python PATH ARGS`` with ``paths`` as PYTHONPATH would put them, for `run` (``functools.partial``)."""
    sys.argv = [path, *args]
    sys.path[:0] = [os.path.dirname(os.path.abspath(path)), *paths]
    runpy.run_path(path, run_name="__main__")


def module(name: str, args: Sequence[str]) -> None:
    """``python -m NAME ARGS`` for `run` (``functools.partial``): the working directory first on sys.path,
    argv[0] the module's file, run as ``__main__``."""
    sys.argv = [name, *args]  # runpy puts the module's file in argv[0]
    sys.path.insert(0, os.getcwd())
    runpy.run_module(name, run_name="__main__", alter_sys=True)


def code(source: str, args: Sequence[str]) -> None:
    """``python -c SOURCE ARGS`` for `run` / `popen` (``functools.partial``)."""
    sys.argv = ["-c", *args]
    sys.path.insert(0, "")
    exec(compile(source, "<string>", "exec"), {"__name__": "__main__"})


class Started:
    """A child `popen` started: ``stdout`` (text) to read while it runs, and the calls a test that kills
    it makes, as on a ``subprocess.Popen``; ``stderr()`` what it wrote there (read when asked)."""

    def __init__(
        self,
        stdout: IO[str],
        err: str,
        done: Callable[[], None],
        *,
        process: BaseProcess | None = None,
        popen: subprocess.Popen[str] | None = None,
    ) -> None:
        self.stdout = stdout
        self._err, self._done, self._process, self._popen = err, done, process, popen

    @property
    def pid(self) -> int:
        pid = self._process.pid if self._process is not None else self._popen.pid  # type: ignore[union-attr]
        assert pid is not None
        return pid

    def poll(self) -> int | None:
        """Its exit status (``-N`` for signal N) once it ended, else None."""
        if self._process is not None:
            return self._process.exitcode
        return self._popen.poll()  # type: ignore[union-attr]

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        """Its exit status; `subprocess.TimeoutExpired` if it has not ended within ``timeout``."""
        if self._process is not None:
            self._process.join(timeout)
        else:
            self._popen.wait(timeout)  # type: ignore[union-attr]
        code = self.poll()
        if code is None:
            raise subprocess.TimeoutExpired("forked child", timeout or 0.0)
        return code

    def stderr(self) -> str:
        return _read(self._err)

    def close(self) -> None:
        """Kill it if it still runs, wait for it, and remove its files."""
        if self.poll() is None:
            self.kill()
        self.wait(60)
        self.stdout.close()
        self._done()


def popen(
    call: Callable[[], object],
    cmd: Sequence[str],
    *,
    cwd: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> Started:
    """Start ``call()`` in a process forked from the fork server, standing in for ``cmd`` as
    ``subprocess.Popen(cmd, stdout=PIPE, text=True, cwd=, env=)`` would start it (stdout a pipe: end
    of file once it has ended), and return at once; ``DSTRAIN_TESTS_SPAWN_ONLY=1`` starts ``cmd``
    itself. Its stderr goes to a file (`Started.stderr`). ``close()`` it when done."""
    env = dict(os.environ if env is None else env)
    cwd = os.fspath(cwd) if cwd is not None else os.getcwd()
    tmp = tempfile.TemporaryDirectory(prefix="forked-output-", dir=env.get("TMPDIR") or None)
    err = os.path.join(tmp.name, "stderr")
    if os.environ.get("DSTRAIN_TESTS_SPAWN_ONLY") == "1":
        with open(err, "w") as f:
            p = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=f, text=True, env=env, cwd=cwd)
        assert p.stdout is not None
        return Started(p.stdout, err, tmp.cleanup, popen=p)
    ctx = context()
    reader, writer = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_in_child, args=(call, cwd, env, writer, err))
    process.start()
    writer.close()  # the child's copy is its only writer: end of file when it ends
    stdout = os.fdopen(reader.fileno(), "r", closefd=False)

    def done() -> None:
        reader.close()
        tmp.cleanup()

    return Started(stdout, err, done, process=process)
