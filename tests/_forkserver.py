"""The one fork server of the test session: child processes that start in ~0.1 s instead of ~2-4 s.

A ``spawn`` child is a new interpreter that imports torch (~2 s of CPU on this 2-core machine, 4-8 s of
wall under load) before it does anything. multiprocessing's fork server imports the modules named here
once, in a clean single-purpose process started on first use (no pytest threads, no CUDA, no event
loops), and forks every later child from it: each child is still a new process with its own memory,
fresh RNG state and nothing of an earlier child's, but it skips the imports.

multiprocessing has ONE fork server per process and its preload list is fixed when the server starts,
so every user takes its context from here: whichever test starts the server first, the list is the same.
What a forked child does NOT get from the caller (it is forked from the server, not from pytest): the
caller's current environment (the server's is the one at its start) and anything the C library reads
once at start-up (``MALLOC_*`` tunables, a cgroup charge for the imported pages). Callers that set
environment variables pass ``os.environ`` along and apply it in the child (``_dstrain_helpers.spawn``
does); a test whose subject is process start-up or memory accounting keeps ``spawn``.
"""

from __future__ import annotations

import multiprocessing
from multiprocessing.context import BaseContext

__all__ = ["PRELOAD", "context"]

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
