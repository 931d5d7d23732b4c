"""Checksums the engine computes as a read's bytes land (`dsio._sums.ReadSums`, ``pread(sums=)``).

Every route a read takes (staged through the pool into fresh memory, O_DIRECT straight into
resident memory, buffered; with an unaligned head and tail) must checksum exactly the fragments
lying wholly inside one of its pieces, with the crc32c of the bytes the file holds there, leave every
other fragment unmarked (the caller's to checksum), still deliver the bytes, and count what it
checksummed; so with any piece size (below and above the 64 KiB crc step), any number of copier
threads and concurrent requests sharing one `ReadSums`; a read cut short marks no fragment past what it
read; with ``SWITCHES.engine_sums`` off nothing is marked.
"""

from __future__ import annotations

import asyncio
import os
import random

import crc32c
import pytest
import torch

import dsio
from dsio._memory import aligned_buffer
from dsio._sums import ReadSums, engine_sums
from dsio._tuning import switched
from dsio.checkpoint._integrity import _advance

MiB = 1 << 20
BLOCK = MiB


def _engine_sums_here() -> None:
    if not engine_sums():
        pytest.skip("this CPU has no crc32c instruction: the engine leaves every fragment to the caller")


def _pieces(offset: int, n: int, direct: bool) -> list[tuple[int, int]]:
    """The engine's pieces (file offsets) of a read of ``n`` bytes at ``offset``: an unaligned head and
    tail are requests of their own on an O_DIRECT file, the body is cut every BLOCK bytes."""
    end = offset + n
    if not direct:
        return [(a, min(a + BLOCK, end)) for a in range(offset, end, BLOCK)]
    lo, hi = -(-offset // 4096) * 4096, end // 4096 * 4096
    out = [(offset, lo)] if lo > offset else []
    out += [(a, min(a + BLOCK, hi)) for a in range(lo, hi, BLOCK)]
    return out + ([(hi, end)] if end > hi else [])


def _memory(n: int, resident: bool, offset: int = 0) -> torch.Tensor:
    """``n`` bytes of fresh (a new mapping, never touched) or faulted-in memory at ``offset``'s place
    within a page (the tensor keeps the mapping alive)."""
    base = torch.frombuffer(aligned_buffer(n + 4096, lock=False), dtype=torch.uint8)
    s = offset % 4096
    out = base[s : s + n]
    if resident:
        out.zero_()
    return out


@pytest.mark.parametrize(
    ("route", "offset"),
    [("staged", 0), ("direct", 0), ("buffered", 0), ("staged", 777), ("direct", 4096 + 5), ("buffered", 3)],
)
def test_the_engine_checksums_each_fragment_inside_a_piece_and_leaves_the_others(tmp_path, route, offset):
    _engine_sums_here()
    data = os.urandom(6 * MiB + 4321)
    path = str(tmp_path / "f.bin")
    with open(path, "wb") as f:
        f.write(data)
    n = 5 * MiB + 123  # an unaligned tail
    end = offset + n
    # fragments: on the piece grid, inside pieces at odd places, and two that straddle a piece edge
    grid = offset if route == "buffered" else 4096 * -(-offset // 4096)
    cuts = sorted(
        {offset, offset + 1000, grid + BLOCK, grid + 2 * BLOCK, grid + 2 * BLOCK + 99_999}
        | {grid + 3 * BLOCK + 5, grid + 4 * BLOCK + 7}  # [2M+99999, 3M+5) and [3M+5, 4M+7) straddle
        | {grid + 5 * BLOCK, end}
    )
    cuts = [c for c in cuts if offset <= c <= end]
    sums = ReadSums(cuts)
    cfg = dsio.IOConfig(
        block_size=BLOCK,
        queue_depth=4,
        intra_op_parallelism=2,
        o_direct=route != "buffered",
        pool_bytes=8 * MiB,
        staging_buffer_bytes=2 * MiB,
    )

    async def main() -> tuple[torch.Tensor, dsio.HandleStatistics, bool]:
        async with dsio.AsyncIOHandle(cfg) as h:
            async with h.open(path, "r") as f:
                direct = f.direct
                if route != "buffered" and not direct:
                    pytest.skip(f"{tmp_path} does not take O_DIRECT")
                out = _memory(n, resident=route == "direct", offset=offset)
                await f.pread(out, offset, sums=sums)
            return out, h.statistics(), direct

    out, st, direct = asyncio.run(main())
    assert out.numpy().tobytes() == data[offset:end]  # the copy out is intact
    if route == "staged":
        assert st.staged_bytes > 0 and st.engine.staged_copy_bytes > 0
    elif route == "direct":
        assert st.direct_bytes > 0 and st.staged_bytes == 0
    pieces = _pieces(offset, n, direct)
    summed = 0
    for (a, b), got in zip(zip(cuts, cuts[1:]), sums.values(), strict=True):
        inside = any(p <= a and b <= q for p, q in pieces)
        if inside:
            assert got == crc32c.crc32c(data[a:b]), (a, b)
            summed += b - a
        else:
            assert got is None, (a, b)
    assert summed >= MiB  # whole pieces of the read were checksummed on the way
    assert st.engine.checksummed_bytes == summed


def test_with_the_switch_off_nothing_is_marked(tmp_path):
    data = os.urandom(3 * MiB)
    path = str(tmp_path / "f.bin")
    with open(path, "wb") as f:
        f.write(data)
    sums = ReadSums([0, MiB, 2 * MiB, 3 * MiB])

    async def main() -> dsio.HandleStatistics:
        async with dsio.AsyncIOHandle(block_size=BLOCK) as h:
            async with h.open(path, "r") as f:
                out = _memory(3 * MiB, resident=False)
                with switched(engine_sums=False):
                    await f.pread(out, 0, sums=sums)
                assert out.numpy().tobytes() == data
            return h.statistics()

    st = asyncio.run(main())
    assert sums.values() == [None, None, None]
    assert st.engine.checksummed_bytes == 0


def test_cuts_must_increase():
    for bad in ([], [5], [0, 0], [3, 2], [-1, 4]):
        with pytest.raises(ValueError):
            ReadSums(bad)


def test_native_combine_agrees_with_the_matrix_products():
    """crc_extend's native join (any length but the 1 MiB table's) is zlib's combine for crc32c:
    the same register as advancing over the zero bytes with GF(2) matrices, and the whole crc32c."""
    from dsio._native import native

    data = os.urandom(70_001)
    for k in (0, 1, 7, 8, 4095, 4096, 65_537, 70_000, 70_001):
        a, b = crc32c.crc32c(data[:k]), crc32c.crc32c(data[k:])
        assert native().crc32c_combine(a, b, len(data) - k) == crc32c.crc32c(data), k
    for reg in (1, 0x80000000, 0xDEADBEEF):
        for length in (1, 3, 1000, (1 << 20) + 1, 1 << 33):
            assert native().crc32c_combine(reg, 0, length) == _advance(reg, length), (reg, length)


def _grid_inside(a: int, b: int, block: int, eof: int) -> bool:
    """Whether fragment ``[a, b)`` lies wholly inside one engine piece of an aligned read that the
    engine cuts every ``block`` bytes from offset 0, the file ending at ``eof``."""
    return a // block == (b - 1) // block and b <= eof


async def _read_in_quarters(
    cfg: dsio.IOConfig, path: str, data: bytes, sums: ReadSums, copiers: int, resident: bool
) -> int:
    """``path`` read whole as 4 concurrent requests sharing ``sums``, with ``copiers`` copier threads;
    the bytes checked; returns the engine's checksummed bytes."""
    n = len(data)
    async with dsio.AsyncIOHandle(cfg) as h:
        h._engine.copy_threads = copiers
        async with h.open(path, "r") as f:
            out = _memory(n, resident=resident)
            q = n // 4
            await asyncio.gather(*(f.pread(out[i : i + q], i, sums=sums) for i in range(0, n, q)))
            assert out.numpy().tobytes() == data
        return h.statistics().engine.checksummed_bytes


async def _read_while_it_shrinks(cfg: dsio.IOConfig, path: str, n: int, sums: ReadSums, cut_to: int) -> None:
    """A read of ``n`` bytes of ``path`` with ``sums``, the file truncated to ``cut_to`` once open."""
    async with dsio.AsyncIOHandle(cfg) as h, h.open(path, "r") as f:
        os.truncate(path, cut_to)
        with pytest.raises(dsio.errors.ShortIOError):
            await f.pread(_memory(n, resident=True), 0, sums=sums)


@pytest.mark.parametrize("block", [4096, 16 << 10, MiB])  # below, at and above a 64 KiB crc step
def test_random_fragments_shared_by_concurrent_reads_on_every_copier_count(backend, data_dir, block):
    """Hundreds of random fragments (tiny ones, ones spanning many pieces) over one 4 MiB file, read
    as 4 concurrent requests that share one `ReadSums` (a span read in parts), with 0 (the reaping
    worker), 1 and 3 copier threads, into fresh and resident memory: exactly the fragments inside one
    piece are marked, each with the file's crc32c, and the engine counts exactly their bytes."""
    _engine_sums_here()
    n = 4 * MiB
    data = os.urandom(n)
    path = os.path.join(data_dir, "f.bin")
    with open(path, "wb") as f:
        f.write(data)
    rng = random.Random(block)
    for copiers, resident in ((0, True), (1, False), (3, False), (3, True)):
        cuts = sorted({0, n} | {rng.randrange(n) for _ in range(rng.randrange(50, 400))})
        sums = ReadSums(cuts)
        cfg = dsio.IOConfig(
            backend=backend, block_size=block, queue_depth=4, intra_op_parallelism=2, pool_bytes=8 * MiB
        )
        counted = asyncio.run(_read_in_quarters(cfg, path, data, sums, copiers, resident))
        summed = 0
        for (a, b), got in zip(zip(cuts, cuts[1:]), sums.values(), strict=True):
            if _grid_inside(a, b, block, n):
                assert got == crc32c.crc32c(data[a:b]), (copiers, resident, a, b)
                summed += b - a
            else:
                assert got is None, (copiers, resident, a, b)
        assert counted == summed, (copiers, resident)


@pytest.mark.parametrize("block", [4096, MiB])
@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_a_read_cut_short_marks_no_fragment_past_the_bytes_it_read(tmp_path, monkeypatch, block, direct):
    """The file shrinks under a read (after the size check): the read is ``ShortIOError``, and no
    fragment reaching past what the file still holds is marked (its bytes were never read); those
    marked before the cut have the file's crc32c."""
    _engine_sums_here()
    from dsio import _op

    n = 3 * MiB
    data = os.urandom(n)
    path = str(tmp_path / "f.bin")
    monkeypatch.setattr(_op, "check_readable", lambda *a: None)  # the shrink comes after the check
    rng = random.Random(7)
    for cut_to in (MiB + 12_345, 2 * MiB, n - 1):
        with open(path, "wb") as f:
            f.write(data)
        cuts = sorted({0, n} | {rng.randrange(n) for _ in range(200)} | {cut_to - 5, cut_to, cut_to + 5})
        sums = ReadSums(cuts)
        cfg = dsio.IOConfig(block_size=block, queue_depth=4, intra_op_parallelism=2, o_direct=direct)
        asyncio.run(_read_while_it_shrinks(cfg, path, n, sums, cut_to))
        marked = 0
        for (a, b), got in zip(zip(cuts, cuts[1:]), sums.values(), strict=True):
            if got is not None:
                assert b <= cut_to, (cut_to, a, b)
                assert got == crc32c.crc32c(data[a:b]), (cut_to, a, b)
                marked += 1
        assert marked, cut_to  # pieces before the cut were read in full and checksummed
