"""The staging pool on transparent huge pages (issue 17): a staged read's speed depended on where
a 4 KiB-page pool's pages landed; a huge-page pool runs at the direct path's speed. These tests
check the memory really is huge-page backed (the kernel's own accounting, /proc/self/smaps), that
opting out gives 4 KiB pages, and that the aligned mapping is freed whole."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

import dsio
import dsio.pool
from dsio import PinnedPool
from dsio._native import native
from dsio._tuning import SWITCHES

MIB = 1 << 20
THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode() -> str | None:
    """The bracketed THP mode ("always", "madvise", "never"), None without THP."""
    try:
        with open(THP) as f:
            text = f.read()
    except OSError:
        return None
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else None


needs_thp = pytest.mark.skipif(
    thp_mode() not in ("always", "madvise"), reason=f"transparent huge pages off here ({thp_mode()})"
)


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


def mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


@needs_thp
def test_pool_on_huge_pages_when_asked():
    with PinnedPool(8 * MIB, MIB, hugepage=True) as pool:
        st = pool.statistics()
        assert st.hugepages and st.locked
        base = pool.try_acquire()
        assert base is not None
        assert base.ptr % (2 * MIB) == 0  # the region starts on a huge-page boundary
        # mlock populated it: the kernel backs (at least part of) it with huge pages. Under
        # memory fragmentation a step may fall back to 4 KiB pages, so not all 8 MiB is required.
        assert anon_huge_kib(base.ptr) >= 2048
        base.release()


@pytest.mark.skipif(
    thp_mode() != "madvise", reason=f"THP mode {thp_mode()}: only 'madvise' honours opting out"
)
def test_pool_opts_out_of_huge_pages():
    with PinnedPool(8 * MIB, MIB, hugepage=False) as pool:
        assert not pool.statistics().hugepages
        lease = pool.try_acquire()
        assert lease is not None
        assert anon_huge_kib(lease.ptr) == 0
        lease.release()


def test_handle_pool_follows_the_module_switch(monkeypatch):
    async def pool_hugepages() -> bool:
        async with dsio.AsyncIOHandle(dsio.IOConfig(pool_bytes=4 * MIB, staging_buffer_bytes=MIB)) as h:
            return h.statistics().pool.hugepages

    monkeypatch.setattr(SWITCHES, "hugepages", False)
    assert not asyncio.run(pool_hugepages())
    monkeypatch.setattr(SWITCHES, "hugepages", True)
    assert asyncio.run(pool_hugepages()) == (thp_mode() in ("always", "madvise"))


def test_small_and_odd_sized_huge_buffers_work_and_unmap_whole():
    C = native()
    small = C.AlignedBuffer(MIB, True, True)  # below one huge page: plain pages, no advice
    assert not small.hugepage and small.ptr % 4096 == 0
    del small
    before = vm0 = 0
    for i in range(21):
        if i == 1:  # after one warm-up cycle (torch's first fill_ maps memory of its own)
            before, vm0 = mappings(), _vm_size_kib()
        n = 3 * MIB + 4096  # not a multiple of 2 MiB: the tail is ordinary pages
        b = C.AlignedBuffer(n, True, True)
        assert b.ptr % (2 * MIB) == 0 and b.nbytes == n
        t = torch.frombuffer(b, dtype=torch.uint8)
        t.fill_(7)
        t[-1] = 9
        assert int(t[0]) == 7 and int(t[-1]) == 9
        del t, b
    # The over-allocation (head and tail trimmed at once) and the buffer itself are all unmapped.
    assert mappings() <= before + 2
    assert _vm_size_kib() - vm0 < 4 * 1024


def _vm_size_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1])
    raise AssertionError("no VmSize")


@needs_thp
def test_staged_read_goes_through_the_huge_page_pool(tmp_path):
    """An ordinary (not 4096-aligned) destination is read through the pool: bytes exact, the
    handle's pool on huge pages, every byte counted as staged."""
    data = torch.randint(0, 256, (6 * MIB,), dtype=torch.uint8)
    path = os.fspath(tmp_path / "t.bin")
    data.numpy().tofile(path)

    async def main() -> None:
        async with dsio.AsyncIOHandle(dsio.IOConfig(pool_bytes=8 * MIB, staging_buffer_bytes=2 * MIB)) as h:
            backing = torch.empty(6 * MIB + 64, dtype=torch.uint8)
            dst = backing[64:]  # 64 bytes past torch's alignment: never page-congruent
            await h.pread(dst, path)
            assert torch.equal(dst, data)
            st = h.statistics()
            assert st.pool.hugepages
            assert st.staged_bytes >= 6 * MIB - 8192

    asyncio.run(main())
