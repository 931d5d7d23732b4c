"""Direct reads into fresh memory: the destination's fresh whole 2 MiB steps are advised
MADV_HUGEPAGE at once, before any I/O, so the steps the kernel faults in itself (pinning pages for
O_DIRECT: the workers' first window, and any step the I/O reaches before the prefault thread)
are huge pages too, not only the steps the prefault thread populates (issue 17)."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

import dsio
from dsio._native import native

MIB = 1 << 20
STEP = 2 * MIB


def thp_mode() -> str | None:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        return None


def anon_huge_kib(addr: int) -> int:
    """AnonHugePages (KiB) of the mapping holding ``addr`` in this process."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {addr:#x}")


def _interior(ptr: int, n: int) -> tuple[int, int]:
    lo = (ptr + STEP - 1) & ~(STEP - 1)
    hi = (ptr + n) & ~(STEP - 1)
    return lo, hi


def test_advise_hugepage_counts_only_fresh_whole_steps():
    C = native()
    mem = C.AlignedBuffer(9 * MIB, False)  # fresh, not 2 MiB-aligned in general
    lo, hi = _interior(mem.ptr, 9 * MIB)
    t = torch.frombuffer(mem, dtype=torch.uint8)
    t[lo - mem.ptr : lo - mem.ptr + 4096].fill_(1)  # the first whole step is no longer fresh
    assert C.advise_hugepage(mem.ptr, 9 * MIB) == (hi - lo) - STEP
    touched = torch.ones(8 * MIB, dtype=torch.uint8)
    assert C.advise_hugepage(touched.data_ptr(), 8 * MIB) == 0  # resident: left alone
    assert C.advise_hugepage(4096, 4 * MIB) == 0  # nothing mapped there: no error, nothing advised


@pytest.mark.skipif(thp_mode() not in ("madvise", "always"), reason=f"THP mode {thp_mode()}")
@pytest.mark.skipif(not native().populate_write_supported(), reason="kernel lacks MADV_POPULATE_WRITE")
def test_fresh_direct_destination_is_huge_pages_window_included(tmp_path):
    n = 24 * MIB
    data = torch.randint(0, 256, (n,), dtype=torch.uint8)
    path = os.fspath(tmp_path / "t.bin")
    data.numpy().tofile(path)
    # Window = block_size x queue_depth x workers = 8 MiB: the workers fault it in themselves.
    cfg = dsio.IOConfig(block_size=MIB, queue_depth=8, intra_op_parallelism=1)

    async def main() -> None:
        async with dsio.AsyncIOHandle(cfg) as h:
            mem = native().AlignedBuffer(n, False)  # page-aligned, never touched: direct read
            dst = torch.frombuffer(mem, dtype=torch.uint8)
            await h.pread(dst, path)
            assert torch.equal(dst, data)
            lo, hi = _interior(mem.ptr, n)
            # Advised as a whole, the interior is one mapping of huge pages. Step by step (the old
            # way) the 8 MiB window stayed on 4 KiB pages: at least 4 MiB short.
            assert anon_huge_kib(lo) * 1024 >= (hi - lo) - 2 * MIB
            assert h._engine.statistics()["prefault"]["hugepage_bytes"] >= (hi - lo) - 8 * MIB

    asyncio.run(main())
