"""``python -m torch.distributed.run ARGS`` for the tests, with the launcher forked from the session's fork server.

`run` returns what ``subprocess.run([sys.executable, "-m", "torch.distributed.run", *args],
capture_output=True, text=True, ...)`` returns (a `subprocess.CompletedProcess` with the launcher's exit
status, stdout and stderr; `subprocess.TimeoutExpired` past ``timeout``, the launcher killed), and the
launch is the same one: torchrun's own ``main`` (torch.distributed.run, run as ``python -m`` runs it) in a
process of its own, with the caller's environment and working directory, starting every rank as a new
interpreter (``python -u SCRIPT``), whose output goes where the launcher's goes.

What differs is how the launcher process starts: forked from tests/_forkserver.py (`_forkserver.run`),
which has imported torch and torch.distributed.run already, instead of a new interpreter importing them
(~1.5-2.5 CPU-s and 2-5 s of wall a launch on this 2-core machine, paid before any rank starts). The
ranks, whose start-up, work and exit the tests judge, are untouched. ``DSTRAIN_TESTS_SPAWN_ONLY=1`` (as
for the forked ranks) launches a new interpreter instead.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence

import _forkserver

__all__ = ["run"]


def _main(args: list[str]) -> None:
    """In the forked process: torchrun's ``main`` as ``python -m torch.distributed.run ARGS`` calls it."""
    sys.argv = [sys.argv[0], *args]
    from torch.distributed.run import main

    main(args)


def run(
    args: Sequence[str],
    *,
    cwd: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float,
) -> subprocess.CompletedProcess[str]:
    """``python -m torch.distributed.run *args`` in ``cwd`` with ``env`` (default: this process's)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", *args]
    return _forkserver.run(functools.partial(_main, list(args)), cmd, cwd=cwd, env=env, timeout=timeout)
