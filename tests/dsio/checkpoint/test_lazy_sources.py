"""Lazy tensor sources: a state holding `FileRegions` (bytes in other files) saves as ordinary
tensors, checksummed, through fixed windows, and loads back (also with stock safetensors)."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

pytest.importorskip("dsio._C", reason="dsio's native core is not built here")

import dsio.checkpoint as C  # noqa: E402
from dsio.checkpoint._stream import STREAM_CHUNK_BYTES  # noqa: E402


def _swap_file(path: str, pieces: list[torch.Tensor], gap: int = 4096) -> list[tuple[str, int, int]]:
    """Write ``pieces`` into one file at page-aligned slots with junk between; their regions."""
    regions, pos = [], 0
    with open(path, "wb") as f:
        for t in pieces:
            b = t.contiguous().view(torch.uint8).numpy().tobytes()
            f.write(b)
            regions.append((path, pos, len(b)))
            pad = (-len(b)) % 4096 + gap
            f.write(b"\xa5" * pad)  # junk that must never reach the checkpoint
            pos += len(b) + pad
    return regions


def test_file_regions_save_and_load_as_tensors(tmp_path) -> None:
    g = torch.Generator().manual_seed(0)
    # a tensor bigger than one window, cut into uneven pieces (not multiples of a page)
    big = torch.randn(STREAM_CHUNK_BYTES // 4 * 2 + 12345, generator=g)
    cuts = [0, 1000, 700_001, 2_500_000, big.numel()]
    pieces = [big[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
    regions = _swap_file(str(tmp_path / "swap.bin"), pieces)
    small = torch.arange(10, dtype=torch.int64)
    half = torch.randn(333, generator=g).to(torch.bfloat16)
    state = {
        "opt": {"exp_avg": C.FileRegions(regions, torch.float32, (big.numel(),)), "step": 7},
        "eager": small,
        "half": half,
    }

    async def go() -> object:
        async with C.Checkpointer(tmp_path / "ck") as ck:
            task = await ck.save(1, state)
            await task
            assert ck.statistics().staging_buffer_bytes == 0  # never staged whole
            assert 0 < ck.statistics().last_stream_buffer_bytes <= 3 * STREAM_CHUNK_BYTES
            return await ck.load(1)

    out = asyncio.run(go())
    assert torch.equal(out["opt"]["exp_avg"], big)
    assert out["opt"]["step"] == 7
    assert torch.equal(out["eager"], small) and torch.equal(out["half"], half)
    # a plain safetensors file: stock readers see the lazy tensor as a tensor
    st = pytest.importorskip("safetensors.torch")
    path = tmp_path / "ck" / "step-000000001" / "rank-00000.safetensors"
    plain = st.load_file(str(path))
    assert torch.equal(plain["opt/exp_avg"], big)


def test_streamed_file_is_checksummed(tmp_path) -> None:
    t = torch.randn(50_000)
    regions = _swap_file(str(tmp_path / "swap.bin"), [t[:20_000], t[20_000:]])
    path = tmp_path / "one.safetensors"
    asyncio.run(C.save({"m": C.FileRegions(regions, torch.float32, (50_000,))}, path))
    assert torch.equal(asyncio.run(C.load(path))["m"], t)
    with open(path, "r+b") as f:  # flip one byte of the data section
        f.seek(os.path.getsize(path) - 100)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x01]))
    with pytest.raises(C.ChecksumError):
        asyncio.run(C.load(path))


def test_background_staging_waits_for_sources(tmp_path) -> None:
    """With background staging, ``save`` returns before the sources are read; ``wait_staged``
    returns once they are, and only then may the caller change them."""
    t = torch.randn(STREAM_CHUNK_BYTES // 4 * 3)
    swap = str(tmp_path / "swap.bin")
    regions = _swap_file(swap, [t])
    gate = asyncio.Event()

    class Gated(C.FileRegions):
        async def read_into(self, io, offset, out):  # type: ignore[no-untyped-def]
            await gate.wait()
            await super().read_into(io, offset, out)

    async def go() -> object:
        async with C.Checkpointer(tmp_path / "ck") as ck:
            task = await ck.save(3, {"m": Gated(regions, torch.float32, t.shape)}, background_staging=True)
            assert not task.done()
            waiter = asyncio.ensure_future(ck.wait_staged())
            await asyncio.sleep(0.05)
            assert not waiter.done()  # the source is not read yet: the caller must not change it
            gate.set()
            waited = await waiter
            assert waited > 0.0
            with open(swap, "r+b") as f:  # staged: changing the source now cannot reach the save
                f.write(b"\0" * 4096)
            result = await task
            assert result.blocked_seconds >= waited
            return await ck.load(3)

    assert torch.equal(asyncio.run(go())["m"], t)


def test_file_regions_validate() -> None:
    with pytest.raises(ValueError):
        C.FileRegions([("x", 0, 12)], torch.float32, (4,))  # 12 bytes for a 16-byte tensor
    with pytest.raises(C.UnsupportedStateError):
        C.LazyTensor(torch.complex128, (1,))


def test_a_failed_window_raises_only_once_the_windows_in_flight_ended(tmp_path, monkeypatch) -> None:
    """The streamed writer's join (``dsio._gather.started``): the first lazy read fails while the
    other windows' reads still write into their window buffers; no further window starts, and the
    save raises only after every read in flight ended (the buffers are freed after it returns)."""
    from dsio.checkpoint import _stream

    chunk = 64 << 10
    monkeypatch.setattr(_stream, "STREAM_CHUNK_BYTES", chunk)
    events: list[str] = []

    class Failing(C.LazyTensor):
        async def read_into(self, io, offset, out):  # type: ignore[no-untyped-def]
            first = not events
            events.append("started")
            if first:
                await asyncio.sleep(0.01)
                events.append("failed")
                raise OSError(5, "the first read")
            await asyncio.sleep(0.05)
            out.fill_(1)  # still writing into the window buffer after the first read failed
            events.append("ended")

    n = 8
    sources = {f"t{i}": Failing(torch.float32, (chunk // 4,)) for i in range(n)}
    with pytest.raises(OSError):
        asyncio.run(C.save(sources, tmp_path / "one.safetensors"))
    events.append("raised")
    started = events.count("started")
    assert 1 < started < n  # reads ran concurrently, and the windows stopped starting
    assert events.count("ended") == started - 1 and events[-1] == "raised"
