"""Touch orders: a streamed background save reads the state in the order its owner will change it,
resolves each touch set's future once nothing overlapping it is read any more, and the file it writes
out of file order is still exact and checksummed."""

from __future__ import annotations

import asyncio

import crc32c
import pytest
import torch

pytest.importorskip("dsio._C", reason="dsio's native core is not built here")

import dsio.checkpoint as C  # noqa: E402
from dsio.checkpoint import (  # noqa: E402
    FileSpan,
    MemorySpan,
    _stream,  # noqa: E402
)
from dsio.checkpoint._capture import plan_windows  # noqa: E402
from dsio.checkpoint._format import layout  # noqa: E402
from dsio.checkpoint._integrity import crc_extend  # noqa: E402

CHUNK = 16 << 10
PIECE = 8192  # elements of one "sub-group" (32 KiB: two windows)


def _swap(path: str, m: torch.Tensor) -> list[tuple[str, int, int]]:
    """``m`` cut into page-aligned slots of one file, like a swapper's; the regions."""
    regions, pos = [], 0
    with open(path, "wb") as f:
        for k in range(0, m.numel(), PIECE):
            b = m[k : k + PIECE].numpy().tobytes()
            f.write(b + b"\xa5" * 4096)
            regions.append((path, pos, len(b)))
            pos += len(b) + 4096
    return regions


def _state(tmp_path, n_sub: int = 6) -> tuple[dict, list[list], torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    master = torch.randn(n_sub * PIECE, generator=g)
    m = torch.randn(n_sub * PIECE, generator=g)
    regions = _swap(str(tmp_path / "swap.bin"), m)
    state = {"master": master, "exp_avg": C.FileRegions(regions, torch.float32, (m.numel(),)), "n": 3}
    order = [
        [MemorySpan.of(master[k * PIECE : (k + 1) * PIECE]), FileSpan(*regions[k])] for k in range(n_sub)
    ]
    return state, order, master, m


def test_windows_follow_the_touch_order(tmp_path) -> None:
    state, order, master, _ = _state(tmp_path)
    sources = {"master": master, "exp_avg": state["exp_avg"]}
    entries = layout((n, t.dtype, tuple(t.shape)) for n, t in sources.items())
    data = entries[-1].end
    plan = plan_windows(entries, sources, CHUNK, data, order)
    per_tensor = master.numel() * 4 // CHUNK  # windows of one tensor (12)
    # sub-group k = windows 2k, 2k+1 of the master and the same two of exp_avg, read together
    expect = []
    for k in range(len(order)):
        expect += [2 * k, 2 * k + 1, per_tensor + 2 * k, per_tensor + 2 * k + 1]
    assert plan.order == expect
    assert plan.remaining == [4] * len(order)
    assert sorted(plan.order) == list(range(-(-data // CHUNK)))  # every window exactly once
    # no touch order: file order
    assert plan_windows(entries, sources, CHUNK, data, None).order == list(range(-(-data // CHUNK)))


def test_tensors_not_on_window_boundaries_keep_the_touch_order(tmp_path) -> None:
    """Tensors that end inside a window share it with the next one: the order must still follow the
    touch sets (not collapse to file order through the shared windows)."""
    g = torch.Generator().manual_seed(1)
    n_sub, piece = 4, 5000  # 20,000 bytes per sub-group: no tensor ends on a 16 KiB boundary
    master = torch.randn(n_sub * piece + 7, generator=g)
    m = torch.randn(n_sub * piece, generator=g)
    sources = {"master": master, "m": m}
    entries = layout((n, t.dtype, tuple(t.shape)) for n, t in sources.items())
    order = [
        [MemorySpan.of(master[k * piece : (k + 1) * piece]), MemorySpan.of(m[k * piece : (k + 1) * piece])]
        for k in range(n_sub)
    ]
    plan = plan_windows(entries, sources, CHUNK, entries[-1].end, order)
    # sub-group 0's windows of both tensors come first (were each tensor's windows kept in file
    # order, the window shared at the boundary would pull all of the master's windows ahead)
    e_master, e_m = entries
    need0 = {*range(0, (piece * 4 - 1) // CHUNK + 1)}
    need0 |= {*range(e_m.begin // CHUNK, (e_m.begin + piece * 4 - 1) // CHUNK + 1)}
    assert plan.remaining[0] == len(need0)
    assert set(plan.order[: len(need0)]) == need0


def test_crc_extend_joins_pieces() -> None:
    g = torch.Generator().manual_seed(2)
    data = torch.randint(0, 256, (300_001,), dtype=torch.uint8, generator=g).numpy().tobytes()
    cuts = [0, 1, 4096, 100_000, 299_999, len(data)]
    crc = 0
    for a, b in zip(cuts, cuts[1:], strict=False):
        crc = crc_extend(crc, crc32c.crc32c(data[a:b]), b - a)
    assert crc == crc32c.crc32c(data)


def test_crc_extend_over_whole_blocks_takes_the_table_path_and_agrees() -> None:
    # a big tensor's blocks are joined through byte tables of the 1 MiB operator: the same values
    # as the matrix products, and the crc32c of the whole bytes
    from dsio.checkpoint import _integrity as I

    g = torch.Generator().manual_seed(5)
    data = torch.randint(0, 256, (3 * I.BLOCK_BYTES + 777,), dtype=torch.uint8, generator=g).numpy().tobytes()
    crc = 0
    for a in range(0, len(data), I.BLOCK_BYTES):
        piece = data[a : a + I.BLOCK_BYTES]
        crc = crc_extend(crc, crc32c.crc32c(piece), len(piece))
    assert crc == crc32c.crc32c(data)
    assert I.BLOCK_BYTES in I._TABLES
    for reg in (1, 0x80000000, 0xDEADBEEF, 0x12345678):
        assert crc_extend(reg, 0, I.BLOCK_BYTES) == I._advance(reg, I.BLOCK_BYTES)


@pytest.mark.parametrize("reverse", [False, True])
def test_touch_ordered_save_writes_an_exact_file_and_resolves_sets_in_order(
    tmp_path, monkeypatch, reverse: bool
) -> None:
    """Forward or reversed (the owner changes the last sub-group first), each set resolves as soon
    as its four windows are in, in the order asked for; the file is exact and its checksums (pieces
    joined out of file order) verify."""
    monkeypatch.setattr(_stream, "STREAM_CHUNK_BYTES", CHUNK)
    state, order, master, m = _state(tmp_path)
    if reverse:
        order = order[::-1]
    resolved: list[int] = []

    async def go() -> object:
        async with C.Checkpointer(tmp_path / "ck") as ck:
            task = await ck.save(1, state, background_staging=True, touch_order=order)
            capture = ck.staging_capture
            assert len(capture) == len(order)
            for i, f in enumerate(capture.futures):
                f.add_done_callback(lambda _f, i=i: resolved.append(i))
            await ck.wait_staged()
            await task
            return await ck.load(1)  # checksums verified

    out = asyncio.run(go())
    assert torch.equal(out["master"], master) and torch.equal(out["exp_avg"], m) and out["n"] == 3
    assert resolved == list(range(len(order)))  # the save read them in the order asked for


def test_sets_resolve_when_staging_fails(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(_stream, "STREAM_CHUNK_BYTES", CHUNK)
    state, order, _, _ = _state(tmp_path)
    (tmp_path / "swap.bin").unlink()  # the lazy source cannot be read

    async def go() -> tuple[bool, BaseException | None]:
        async with C.Checkpointer(tmp_path / "ck") as ck:
            task = await ck.save(1, state, background_staging=True, touch_order=order)
            await ck.wait_staged()
            done = all(f.done() for f in ck.staging_capture.futures)
            try:
                await task
            except Exception as e:
                return done, e
            return done, None

    done, error = asyncio.run(go())
    assert done and isinstance(error, OSError)
    assert not (tmp_path / "ck" / "step-000000001").exists()
