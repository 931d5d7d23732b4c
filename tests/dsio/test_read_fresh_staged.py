"""A large read into fresh (never touched) page-aligned memory goes through the staging pool, so the
kernel faults the destination in on the copier threads behind the disk; touched or locked aligned
memory is still read straight into (quiet matrix: staged fresh 1.13-1.17x DeepSpeed's read vs
0.91-1.05x direct with prefaulting, bench/results/io-read-path-quiet-2026-11-30.md)."""

from __future__ import annotations

import asyncio
import mmap

import pytest
import torch

pytest.importorskip("dsio._C", reason="dsio's native core is not built here")

import dsio  # noqa: E402
from dsio import _transfer  # noqa: E402
from dsio._tuning import SWITCHES  # noqa: E402

MIB = 1 << 20
N = 8 * MIB


def _fresh_tensor() -> tuple[mmap.mmap, torch.Tensor]:
    mm = mmap.mmap(-1, N)  # anonymous, page-aligned, nothing faulted in yet
    return mm, torch.frombuffer(mm, dtype=torch.uint8)


def _read(path, dst: torch.Tensor) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    async def go() -> tuple[int, int]:
        h = dsio.AsyncIOHandle()
        try:
            await h.pread(dst, path)
            st = h.statistics()
            return st.direct_bytes, st.staged_bytes
        finally:
            await h.aclose()

    return asyncio.run(go())


@pytest.fixture()
def data(tmp_path):  # type: ignore[no-untyped-def]
    src = torch.randint(0, 256, (N,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    path = tmp_path / "t.bin"
    src.numpy().tofile(path)
    return path, src


def test_fresh_probe() -> None:
    mm, t = _fresh_tensor()
    assert _transfer.fresh(t.data_ptr(), N)
    t[N // 2] = 1  # one touched page in the middle is enough to call it touched
    assert not _transfer.fresh(t.data_ptr(), N)
    mm2, t2 = _fresh_tensor()
    t2.fill_(0)
    assert not _transfer.fresh(t2.data_ptr(), N)
    del t, t2
    mm.close()
    mm2.close()


def test_fresh_aligned_destination_is_staged_and_exact(data) -> None:  # type: ignore[no-untyped-def]
    path, src = data
    mm, dst = _fresh_tensor()
    assert dst.data_ptr() % 4096 == 0
    direct, staged = _read(path, dst)
    assert torch.equal(dst, src)
    assert staged == N and direct == 0


def test_touched_aligned_destination_is_read_directly(data) -> None:  # type: ignore[no-untyped-def]
    path, src = data
    mm, dst = _fresh_tensor()
    dst.fill_(7)
    direct, staged = _read(path, dst)
    assert torch.equal(dst, src)
    assert direct == N and staged == 0


def test_switch_off_reads_fresh_memory_directly(data, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(SWITCHES, "fresh_staged", False)
    path, src = data
    mm, dst = _fresh_tensor()
    direct, staged = _read(path, dst)
    assert torch.equal(dst, src)
    assert direct == N and staged == 0


def test_a_fresh_aligned_read_is_probed_once(data, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The route of a whole aligned read is decided once (`whole_route`): the general path it hands
    a fresh destination to is told so instead of probing (mincore) again."""
    probes: list[int] = []
    probe = _transfer.fresh

    def counted(ptr: int, nbytes: int) -> bool:
        probes.append(nbytes)
        return probe(ptr, nbytes)

    monkeypatch.setattr(_transfer, "fresh", counted)
    path, src = data
    mm, dst = _fresh_tensor()
    direct, staged = _read(path, dst)
    assert torch.equal(dst, src)
    assert staged == N and direct == 0  # it was fresh, and staged
    assert probes == [N]
