"""Loads read back-to-back tensors into one span of memory: the tensors are views of it.

What that must keep: a tensor's bytes live as long as the tensor (whatever happened to the other
views), files whose tensors sit at any byte offset (foreign safetensors files) load exactly, every
request is page-aligned in memory and in the file (O_DIRECT), and checksums are still checked
tensor by tensor across the pieces a span is read in and the fragments the engine checksums on the
way (``SWITCHES.engine_sums``; off, the reader checksums each piece after it is read).
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import struct

import pytest
import safetensors.torch as st
import torch
from ckpt_helpers import flip_byte

import dsio
import dsio.checkpoint as C
from dsio._sums import engine_sums
from dsio._tuning import SWITCHES
from dsio.checkpoint import _read
from dsio.file import AsyncFile


def run(coro):
    return asyncio.run(coro)


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {
        "big": torch.randn(600_001, generator=g),  # 2.4 MB: several pieces at 64 KiB
        "small": torch.randn(17, generator=g),
        "half": torch.randn(33, generator=g).half(),
        "bytes": torch.randint(0, 256, (5,), dtype=torch.uint8, generator=g),
        "empty": torch.zeros(3, 0),
    }


def test_tensors_share_one_span_and_a_kept_view_outlives_the_others(tmp_path):
    state = _state()
    path = str(tmp_path / "s.safetensors")
    run(C.save(state, path))
    back = run(C.load(path))
    storages = {t.untyped_storage().data_ptr() for k, t in back.items() if t.numel()}
    assert len(storages) == 1  # one allocation for the whole file (the documented lifetime)
    kept = back["small"]
    del back
    gc.collect()
    junk = [torch.full((1 << 20,), 3.0) for _ in range(8)]  # reuse freed memory if any was freed
    assert torch.equal(kept, state["small"])
    del junk


def _foreign_file(path: str) -> dict[str, torch.Tensor]:
    """A safetensors file whose header length is odd and whose tensors start at odd offsets."""
    g = torch.Generator().manual_seed(9)
    tensors = {
        "a_u8": torch.randint(0, 256, (3,), dtype=torch.uint8, generator=g),
        "b_f32": torch.randn(5000, generator=g),  # at byte 3 of the data: misaligned for float32
        "c_f64": torch.randn(7, generator=g, dtype=torch.float64),
        "d_big": torch.randn(300_000, generator=g),  # 1.2 MB over several pieces
    }
    header: dict[str, object] = {}
    blobs, pos = [], 0
    for name, t in tensors.items():
        raw = t.contiguous().view(torch.uint8).numpy().tobytes()
        dt = {torch.uint8: "U8", torch.float32: "F32", torch.float64: "F64"}[t.dtype]
        header[name] = {"dtype": dt, "shape": list(t.shape), "data_offsets": [pos, pos + len(raw)]}
        blobs.append(raw)
        pos += len(raw)
    text = json.dumps(header).encode()
    if (8 + len(text)) % 2 == 0:
        text += b" "  # an odd data start: no tensor is aligned to its element size in the file
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))
    return tensors


def test_a_file_with_unaligned_offsets_loads_exactly(tmp_path, monkeypatch):
    monkeypatch.setattr(_read, "PIECE_BYTES", 64 << 10)
    path = str(tmp_path / "foreign.safetensors")
    tensors = _foreign_file(path)
    ref = st.load_file(path)  # the real safetensors reads it too
    back = run(C.load(path))
    assert set(back) == set(tensors)
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t) and torch.equal(ref[k], t), k
        esize = t.element_size()
        assert back[k].data_ptr() % esize == 0, k  # usable memory, copied out where misaligned


def test_every_read_of_a_span_is_page_aligned_and_direct(tmp_path, monkeypatch):
    monkeypatch.setattr(_read, "PIECE_BYTES", 64 << 10)
    path = str(tmp_path / "s.safetensors")
    for name, make in (
        ("dsio", lambda: run(C.save(_state(), path))),
        ("foreign", lambda: _foreign_file(path)),
    ):
        make()
        size = os.path.getsize(path)
        reads: list[tuple[int, int, int, bool]] = []
        real = AsyncFile.pread

        async def pread(self, tensor, offset=0, _real=real, reads=reads, **kw):
            reads.append((tensor.data_ptr(), offset, tensor.numel(), self.direct))
            return await _real(self, tensor, offset, **kw)

        monkeypatch.setattr(AsyncFile, "pread", pread)

        async def load():
            async with dsio.AsyncIOHandle(C.DEFAULT_IO) as h:
                return await C.load(path, handle=h)

        run(load())
        monkeypatch.setattr(AsyncFile, "pread", real)
        if not reads[0][3]:
            pytest.skip(f"{tmp_path} does not take O_DIRECT: the alignment would not be exercised")
        data = reads[1:]  # reads[0]: the header's first 64 KiB
        assert len(data) > 3, name
        for ptr, off, n, direct in data:
            assert direct and ptr % 4096 == 0 and off % 4096 == 0, (name, ptr, off)
            assert n % 4096 == 0 or off + n == size, (name, off, n)  # only the file's tail is partial
        covered = sorted((off, off + n) for _, off, n, _ in data)
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:])), name  # no byte read twice


def _first_piece_end(path: str) -> int:
    """The file offset where the first request of a dsio file's span ends (64 KiB pieces)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
    ds = 8 + n  # a dsio file's data starts on a page: its span's memory begins there
    assert ds % 4096 == 0
    (a, b), *_ = _read.piece_bounds(os.path.getsize(path) - ds, 64 << 10)
    return ds + b


@pytest.mark.parametrize(
    "victim", ["small", "half", "bytes", "big_start", "big_piece_edge", "big_next_piece"]
)
def test_a_flipped_byte_in_any_tensor_of_a_span_is_caught(tmp_path, monkeypatch, victim):
    monkeypatch.setattr(_read, "PIECE_BYTES", 64 << 10)
    path = str(tmp_path / "s.safetensors")
    run(C.save(_state(), path))
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    ds = 8 + n
    edge = _first_piece_end(path)
    name, at = {
        "big_start": ("big", 0),
        # the last byte of the first request and the first of the second (inside "big")
        "big_piece_edge": ("big", edge - 1 - ds - header["big"]["data_offsets"][0]),
        "big_next_piece": ("big", edge - ds - header["big"]["data_offsets"][0]),
    }.get(victim, (victim, 1))
    lo, hi = header[name]["data_offsets"]
    assert 0 <= at < hi - lo, (victim, at)
    pos = ds + lo + at
    flip_byte(path, pos, 0x10)
    with pytest.raises(C.ChecksumError):
        run(C.load(path))
    run(C.load(path, verify=False))  # the caller's explicit choice: no check, no error


@pytest.mark.parametrize("engine", [True, False], ids=["engine_sums", "reader_sums"])
@pytest.mark.parametrize("where", ["first_piece_middle", "second_piece", "last_piece", "last_byte"])
def test_a_piece_checksummed_in_parts_on_several_threads_still_catches_one_flipped_byte(
    tmp_path, monkeypatch, where, engine
):
    """A big piece's checksum is computed by the engine fragment by fragment, or by the reader in
    `CRC_BYTES` parts spread over the checksum threads, and joined per tensor; a flipped byte in any
    part of any piece (the last one too: nothing overlaps its check) must raise before load
    returns, and a clean file loads exactly."""
    monkeypatch.setattr(SWITCHES, "engine_sums", engine)
    monkeypatch.setattr(_read, "PIECE_BYTES", 64 << 10)
    monkeypatch.setattr(_read, "CRC_BYTES", 12 << 10)  # not a page multiple: parts cut anywhere
    state = {"a": torch.randn(7), "big": torch.randn(400_003), "z": torch.randn(3)}
    path = str(tmp_path / "s.safetensors")
    run(C.save(state, path))
    back = run(C.load(path))
    assert all(torch.equal(back[k], v) for k, v in state.items())
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    ds = 8 + n
    bounds = _read.piece_bounds(os.path.getsize(path) - ds, 64 << 10)
    assert len(bounds) >= 4 and (bounds[0][1] - bounds[0][0]) > 4 * (12 << 10)
    pos = {
        "first_piece_middle": ds + bounds[0][1] // 2 + 5,
        "second_piece": ds + bounds[1][0] + 12345,
        "last_piece": ds + bounds[-1][0] + 3,
        "last_byte": ds + header["z"]["data_offsets"][1] - 1,
    }[where]
    flip_byte(path, pos, 0x01)
    with pytest.raises(C.ChecksumError):
        run(C.load(path))


@pytest.mark.parametrize("engine", [True, False], ids=["engine_sums", "reader_sums"])
def test_a_reader_that_skips_a_part_of_a_tensor_is_a_bug_not_a_pass(tmp_path, monkeypatch, engine):
    """`_Sums.finish`: a tensor whose bytes were not all checksummed (a reader's bug: here the
    fragments of the second request are never recorded) fails the load instead of passing unchecked."""
    monkeypatch.setattr(SWITCHES, "engine_sums", engine)
    monkeypatch.setattr(_read, "PIECE_BYTES", 64 << 10)
    path = str(tmp_path / "s.safetensors")
    run(C.save({"big": torch.randn(200_000)}, path))
    real = _read._Sums.take
    calls = []

    def skipping(self, frags, mine):
        calls.append(frags)
        if len(calls) != 2:
            real(self, frags, mine)

    monkeypatch.setattr(_read._Sums, "take", skipping)
    with pytest.raises(RuntimeError, match="unverified"):
        run(C.load(path))


def test_reads_stop_once_a_piece_fails_its_check(tmp_path, monkeypatch):
    monkeypatch.setattr(_read, "PIECE_BYTES", 4096)
    path = str(tmp_path / "s.safetensors")
    run(C.save({"a": torch.randn(1000), "big": torch.randn(1 << 20)}, path))  # 4 MiB: 11 pieces
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    assert header["a"]["data_offsets"][0] == 0  # "a" is checked whole after the first piece
    pieces = len(_read.piece_bounds(os.path.getsize(path) - 8 - n, 4096))
    assert pieces >= 8
    with open(path, "r+b") as f:
        f.seek(8 + n + 10)
        f.write(b"\xff\xff")
    offsets = []
    real = AsyncFile.pread

    async def pread(self, tensor, offset=0, **kw):
        offsets.append(offset)
        if len(offsets) > 2:  # every piece after the first: time for the first one's check (a thread)
            await asyncio.sleep(0.2)
        return await real(self, tensor, offset, **kw)

    monkeypatch.setattr(AsyncFile, "pread", pread)
    with pytest.raises(C.ChecksumError):
        run(C.load(path))
    assert len(offsets) <= 1 + 1 + _read.IN_FLIGHT < 1 + pieces  # the header, the pieces in flight


@pytest.mark.parametrize("engine", [True, False], ids=["engine_sums", "reader_sums"])
def test_a_span_is_one_request_where_the_engine_checksums_else_halves(tmp_path, monkeypatch, engine):
    """With the engine checksumming on the way (the switch on, on a CPU with a crc32c instruction) or
    nothing to checksum (verify=False), a span is ONE request, the raw read's shape. With the checksums the reader's (the switch off), each request
    is half of what is left of the span, at least the handle's staging pool over `IN_FLIGHT`
    (32 MiB with DEFAULT_IO's 64 MiB pool), so that each one's checksum overlaps the next reads."""
    monkeypatch.setattr(SWITCHES, "engine_sums", engine)
    path = str(tmp_path / "s.safetensors")
    run(C.save({"w": torch.randn(10 << 20)}, path))  # 40 MiB of data
    sizes: list[int] = []
    real = AsyncFile.pread

    async def pread(self, tensor, offset=0, **kw):
        sizes.append(tensor.numel())
        return await real(self, tensor, offset, **kw)

    monkeypatch.setattr(AsyncFile, "pread", pread)
    small = dsio.IOConfig(
        block_size=1 << 20, queue_depth=8, pool_bytes=16 << 20, staging_buffer_bytes=4 << 20
    )
    for config, low in ((C.DEFAULT_IO, C.DEFAULT_IO.pool_bytes // _read.IN_FLIGHT), (small, 8 << 20)):
        for verify in (True, False):
            sizes.clear()

            async def load(config=config, verify=verify):
                async with dsio.AsyncIOHandle(config) as h:
                    return await C.load(path, handle=h, verify=verify)

            back = run(load())
            assert back["w"].numel() == 10 << 20
            got = sizes[1:]  # sizes[0]: the header's first read
            total = sum(got)
            assert total >= 40 << 20
            if engine_sums() or not verify:  # the switch on and a crc32c instruction here
                assert got == [total], (config, verify, got)
            else:
                assert got == [b - a for a, b in _read.piece_bounds(total, low)], (config, got)
                assert len(got) > 1 or config is C.DEFAULT_IO  # 40 MiB <= 2 x 32 MiB: one there


def test_piece_bounds_tile_the_span_in_halves():
    mib = 1 << 20
    for n, low in (
        (3049416400 // 4096 * 4096, 32 * mib),
        (40 * mib, 8 * mib),
        (5 * 4096, 4096),
        (4096, 4096),
    ):
        b = _read.piece_bounds(n, low)
        assert b[0][0] == 0 and b[-1][1] == n
        assert all(x[1] == y[0] for x, y in zip(b, b[1:]))  # in order, no gap, no overlap
        assert all(a % 4096 == 0 for a, _ in b)
        for i, (a, e) in enumerate(b[:-1]):
            assert low <= e - a <= (n - a) // 2, (n, i)
        assert b[-1][1] - b[-1][0] <= 2 * low
    assert len(_read.piece_bounds(3049416400 // 4096 * 4096, 32 * mib)) == 7  # bench/checkpoint.py's state
    assert _read.piece_bounds(0, 4096) == []
