"""Helpers shared by the dsio tests: the backends this machine has, tensors with chosen alignment,
random fills, and counts of this process's fds and threads.

A module with a name of its own (not ``conftest``): any subset of the tests, or one node id, imports
it the same way from any directory (tests/conftest.py puts tests/ on ``sys.path``).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any

import pytest
import torch

try:
    import dsio
    from dsio import _C

    AVAILABLE = {s.name: s for s in dsio.backend_status()}
    _NO_DSIO = ""
except Exception as e:  # dsio is not built here (BackendUnavailableError): dstrain tests still run
    AVAILABLE = {}
    _NO_DSIO = f"dsio's native core is not built here: {e}"


def backend_params() -> list[Any]:
    out = []
    for name in ("io_uring", "aio", "posix"):
        st = AVAILABLE.get(name)
        if st is None:
            marks = [pytest.mark.skip(reason=_NO_DSIO)]
        else:
            marks = [] if st.available else [pytest.mark.skip(reason=f"{name} unavailable here: {st.reason}")]
        out.append(pytest.param(name, marks=marks, id=name))
    return out


def run_loop(kind: str, coro: Coroutine[Any, Any, Any]) -> Any:
    """Run ``coro`` on a fresh loop of ``kind`` ("asyncio" or "uvloop"). For tests that need a loop of
    their own (a loop's lifetime is part of what they check); everything else is ``async def`` and gets
    both loops from pytest-asyncio (pytest_asyncio_loop_factories)."""
    if kind == "uvloop":
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as r:
            return r.run(coro)
    with asyncio.Runner() as r:
        return r.run(coro)


def aligned_tensor(nbytes: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """A tensor whose memory starts on a 4096-byte boundary (mlock'ed, like a pinned buffer)."""
    mem = _C.AlignedBuffer(max(nbytes, 1), True)
    t = torch.frombuffer(mem, dtype=torch.uint8)[:nbytes]
    assert t.data_ptr() % 4096 == 0
    return t.view(dtype)


def unaligned_tensor(nbytes: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """A tensor whose memory is deliberately not 4096-aligned (but aligned for its dtype)."""
    esize = torch.empty(0, dtype=dtype).element_size()
    base = torch.empty(nbytes + 3 * 4096, dtype=torch.uint8)
    start = (-base.data_ptr()) % 4096 + 8 * esize  # 4096-aligned address + a few elements
    t = base[start : start + nbytes]
    assert t.data_ptr() % 4096 != 0
    return t.view(dtype)


def fill_random(t: torch.Tensor, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t.view(torch.uint8).copy_(
        torch.randint(0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8, generator=g)
    )
    return t


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def user_threads() -> int:
    """Threads of this process, not counting io_uring's kernel io-wq workers (they exit on their own)."""
    n = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except FileNotFoundError:
            continue
        if not name.startswith("iou-"):
            n += 1
    return n
