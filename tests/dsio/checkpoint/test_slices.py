"""Byte-range slice reads (dsio.checkpoint.SliceReader / read_slices) from real safetensors files:
written by the ``safetensors`` package (Hugging Face's layout) and by dsio itself."""

from __future__ import annotations

import asyncio
import os
import pickle
import struct

import pytest
import torch
from ckpt_helpers import flip_byte
from safetensors.torch import save_file

import dsio
from dsio.checkpoint import (
    CheckpointFormatError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    ChecksumError,
    SliceRangeError,
    SliceReader,
    TensorInfo,
    TensorNotFoundError,
    TensorSlice,
    read_slices,
)


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        # odd sizes so that tensors start at offsets that are not page- or element-aligned across dtypes
        "wte.weight": torch.randn(1031, 67, generator=g),
        "h.0.ln.bias": torch.randn(67, generator=g).to(torch.bfloat16),
        "h.0.mlp.w": torch.randn(3, 4099, generator=g).to(torch.float16),
        "step": torch.tensor([7], dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
    }


@pytest.fixture
def hf_file(tmp_path):
    path = tmp_path / "model.safetensors"
    t = _tensors()
    save_file(t, str(path), metadata={"format": "pt"})
    return str(path), t


@pytest.fixture
def dsio_file(tmp_path):
    path = tmp_path / "own.safetensors"
    t = _tensors()
    asyncio.run(dsio.checkpoint.save(t, str(path)))
    return str(path), t


def _run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("which", ["hf_file", "dsio_file"])
def test_slices_equal_the_flat_ranges(which, request):
    path, t = request.getfixturevalue(which)
    cases = [
        ("wte.weight", 0, 1031 * 67),  # whole
        ("wte.weight", 1, 4097),  # unaligned start, crosses pages
        ("wte.weight", 1031 * 67 - 5, 1031 * 67),  # tail
        ("h.0.mlp.w", 2048, 2048 + 8192),
        ("h.0.ln.bias", 3, 60),
        ("step", 0, 1),
        ("mask", 1, 3),
        ("wte.weight", 100, 100),  # empty
    ]
    outs = [torch.full((b - a,), 0, dtype=t[n].dtype) for n, a, b in cases]
    got = _run(read_slices(path, [TensorSlice(n, o, a) for (n, a, _), o in zip(cases, outs)]))
    for (n, a, b), o in zip(cases, outs):
        assert torch.equal(o, t[n].reshape(-1)[a:b]), (n, a, b)
    esize = {n: v.element_size() for n, v in t.items()}
    assert got == sum((b - a) * esize[n] for n, a, b in cases)


def test_reads_only_the_requested_bytes(hf_file):
    path, t = hf_file

    async def main():
        async with (
            dsio.AsyncIOHandle(dsio.checkpoint.DEFAULT_IO) as h,
            await SliceReader.open(path, handle=h) as r,
        ):
            before = h.statistics().read_bytes
            out = torch.empty(5000)
            await r.read([TensorSlice("wte.weight", out, 20000)])
            return out, h.statistics().read_bytes - before

    out, moved = _run(main())
    assert torch.equal(out, t["wte.weight"].reshape(-1)[20000:25000])
    # the caller's bytes, plus at most the partial pages at each end that O_DIRECT must read
    assert 20000 <= moved <= 20000 + 2 * 4096


def test_destination_of_another_shape_and_page_aligned(dsio_file):
    path, t = dsio_file
    out = torch.empty(1031, 67)  # whole tensor into a 2-D destination
    aligned = torch.empty(4096 * 3, dtype=torch.uint8)
    s = (-aligned.data_ptr()) % 4096
    a_out = aligned[s : s + 4096 * 2].view(torch.float32)  # page-aligned destination (O_DIRECT body)
    _run(read_slices(path, [TensorSlice("wte.weight", out), TensorSlice("wte.weight", a_out, 1024)]))
    assert torch.equal(out, t["wte.weight"])
    assert torch.equal(a_out, t["wte.weight"].reshape(-1)[1024 : 1024 + 2048])


def test_dtype_conversion_when_asked(hf_file, monkeypatch):
    import dsio.checkpoint._slices as S

    monkeypatch.setattr(S, "CONVERT_CHUNK_BYTES", 4096)  # many chunks, each converted
    path, t = hf_file
    out32 = torch.empty(10000, dtype=torch.float32)
    out16 = torch.empty(1031 * 67, dtype=torch.bfloat16)
    with pytest.raises(CheckpointMismatchError):
        _run(read_slices(path, [TensorSlice("h.0.mlp.w", out32, 7)]))
    _run(
        read_slices(
            path, [TensorSlice("h.0.mlp.w", out32, 7), TensorSlice("wte.weight", out16)], convert=True
        )
    )
    assert torch.equal(out32, t["h.0.mlp.w"].reshape(-1)[7:10007].float())
    assert torch.equal(out16, t["wte.weight"].reshape(-1).to(torch.bfloat16))


def test_header_index(hf_file):
    path, t = hf_file

    async def main():
        async with await SliceReader.open(path) as r:
            return dict(r.tensors), dict(r.metadata)

    tensors, meta = _run(main())
    assert tensors == {n: TensorInfo(v.dtype, tuple(v.shape)) for n, v in t.items()}
    assert tensors["wte.weight"].numel == 1031 * 67
    assert meta == {"format": "pt"}


def test_missing_names_are_listed_and_nothing_is_read(hf_file):
    path, _ = hf_file
    keep = torch.full((4,), -1.0)
    with pytest.raises(TensorNotFoundError) as ei:
        _run(
            read_slices(
                path,
                [
                    TensorSlice("wte.weight", keep),
                    TensorSlice("lm_head.weight", torch.empty(1)),
                    TensorSlice("a.b", torch.empty(1)),
                ],
            )
        )
    assert ei.value.names == ("a.b", "lm_head.weight")
    assert isinstance(ei.value, KeyError)
    assert torch.equal(keep, torch.full((4,), -1.0))  # checked before any read
    again = pickle.loads(pickle.dumps(ei.value))
    assert type(again) is TensorNotFoundError and again.names == ei.value.names


@pytest.mark.parametrize("start,n", [(-1, 2), (67 * 1031 - 1, 2), (67 * 1031, 1)])
def test_out_of_range(hf_file, start, n):
    path, _ = hf_file
    with pytest.raises(SliceRangeError) as ei:
        _run(read_slices(path, [TensorSlice("wte.weight", torch.empty(n), start)]))
    assert ei.value.numel == 67 * 1031 and ei.value.stop == start + n
    assert isinstance(pickle.loads(pickle.dumps(ei.value)), SliceRangeError)


def test_non_contiguous_destination(hf_file):
    path, _ = hf_file
    with pytest.raises(dsio.TensorLayoutError):
        _run(read_slices(path, [TensorSlice("wte.weight", torch.empty(10, 4)[:, 1])]))


def test_whole_tensor_slices_are_checked_against_dsio_crc(dsio_file):
    path, t = dsio_file

    async def offset_of(name):
        async with await SliceReader.open(path) as r:
            e = r._entries[name]
            return r._header.data_start + e.begin

    off = _run(offset_of("wte.weight"))
    with open(path, "r+b") as f:  # flip one byte inside the tensor, 40 bytes in
        f.seek(off + 40)
        b = f.read(1)
        f.seek(off + 40)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(ChecksumError):
        _run(read_slices(path, [TensorSlice("wte.weight", torch.empty(1031 * 67))]))
    with pytest.raises(ChecksumError):  # also through the converting path
        _run(
            read_slices(
                path, [TensorSlice("wte.weight", torch.empty(1031 * 67, dtype=torch.float64))], convert=True
            )
        )
    # a partial slice is checked too: the tensor is one block, read whole and checked (the flipped
    # byte lies outside these 100 elements)
    with pytest.raises(ChecksumError):
        _run(read_slices(path, [TensorSlice("wte.weight", torch.empty(100), 1000)]))
    out = torch.empty(100)
    _run(read_slices(path, [TensorSlice("wte.weight", out, 1000)], verify=False))
    assert torch.equal(out, t["wte.weight"].reshape(-1)[1000:1100])
    _run(read_slices(path, [TensorSlice("wte.weight", torch.empty(1031 * 67))], verify=False))


BLOCK = 1 << 20  # dsio.checkpoint._integrity.BLOCK_BYTES


@pytest.fixture
def big_dsio_file(tmp_path):
    """A dsio file with a tensor of 5.5 blocks (its blocks' crc32c recorded) after a small one."""
    path = tmp_path / "big.safetensors"
    g = torch.Generator().manual_seed(9)
    t = {"bias": torch.randn(37, generator=g), "w": torch.randn(11 * BLOCK // 8, generator=g)}
    asyncio.run(dsio.checkpoint.save(t, str(path)))

    async def offset_of(name):
        async with await SliceReader.open(path) as r:
            e = r._entries[name]
            return r._header.data_start + e.begin

    return str(path), t, _run(offset_of("w"))


@pytest.mark.parametrize("where", ["inner block", "first edge block", "last edge block"])
def test_a_flipped_bit_inside_a_partial_slice_is_a_checksum_error(big_dsio_file, where):
    """Every 1 MiB block a slice touches is checked (edges read whole): a flipped bit in the slice's
    bytes is ChecksumError, whether it lies in a block the slice covers or in one it covers partly."""
    path, t, off = big_dsio_file
    start, stop = BLOCK // 4 + 3, 4 * BLOCK // 4 - 5  # elements (fp32): bytes ~1 MiB + 12 .. ~4 MiB - 20
    flip = {
        "inner block": 2 * BLOCK + 100,
        "first edge block": 4 * start + 8,
        "last edge block": 4 * stop - 8,
    }
    flip_byte(path, off + flip[where], 0x20)
    with pytest.raises(ChecksumError):
        _run(read_slices(path, [TensorSlice("w", torch.empty(stop - start), start)]))
    with pytest.raises(ChecksumError):  # also through the converting path
        _run(
            read_slices(
                path, [TensorSlice("w", torch.empty(stop - start, dtype=torch.float64), start)], convert=True
            )
        )
    # unchecked, the slice holds the flipped bit; a slice of other blocks reads exact and checked
    out = torch.empty(stop - start)
    _run(read_slices(path, [TensorSlice("w", out, start)], verify=False))
    assert not torch.equal(out, t["w"][start:stop])
    far = torch.empty(1000)
    _run(read_slices(path, [TensorSlice("w", far, 5 * BLOCK // 4 + 10)]))
    assert torch.equal(far, t["w"][5 * BLOCK // 4 + 10 : 5 * BLOCK // 4 + 1010])


def test_a_checked_slice_reads_at_most_one_block_more_at_each_end(big_dsio_file):
    path, t, _ = big_dsio_file
    cases = [
        (10, 20),
        (BLOCK // 4 - 1, BLOCK // 4 + 1),
        (BLOCK // 4, 2 * BLOCK // 4),
        (3, 11 * BLOCK // 8 - 2),
    ]

    async def main():
        async with (
            dsio.AsyncIOHandle(dsio.checkpoint.DEFAULT_IO) as h,
            await SliceReader.open(path, handle=h) as r,
        ):
            moved = []
            for a, b in cases:
                out = torch.empty(b - a, dtype=torch.float64)
                before = h.statistics().read_bytes
                await r.read([TensorSlice("w", out, a)], convert=True)
                moved.append(h.statistics().read_bytes - before)
                assert torch.equal(out, t["w"][a:b].double()), (a, b)
            return moved

    for (a, b), n in zip(cases, _run(main()), strict=True):
        first, last = 4 * a // BLOCK, (4 * b - 1) // BLOCK
        assert n <= (last - first + 1) * BLOCK, (a, b, n)  # whole blocks, nothing beyond
        assert n >= 4 * (b - a), (a, b, n)


def test_bad_headers_are_refused_before_allocating(tmp_path):
    huge = tmp_path / "huge.safetensors"
    huge.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(CheckpointFormatError):
        _run(SliceReader.open(huge))
    big = tmp_path / "big.safetensors"  # a real header, but over the caller's limit
    save_file({"x": torch.zeros(3)}, str(big), metadata={"pad": "x" * 5000})
    with pytest.raises(CheckpointFormatError):
        _run(SliceReader.open(big, max_header_bytes=1024))
    short = tmp_path / "short.safetensors"
    save_file({"x": torch.zeros(300)}, str(short))
    with open(short, "r+b") as f:
        f.truncate(os.path.getsize(short) - 4)
    with pytest.raises(CheckpointFormatError):
        _run(SliceReader.open(short))
    garbage = tmp_path / "garbage.safetensors"
    body = b'{"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 12]}}'
    garbage.write_bytes(struct.pack("<Q", len(body)) + body + b"\0" * 12)
    with pytest.raises(CheckpointFormatError):
        _run(SliceReader.open(garbage))
    with pytest.raises(CheckpointNotFoundError):
        _run(SliceReader.open(tmp_path / "absent.safetensors"))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(CheckpointFormatError):
        _run(SliceReader.open(fifo))


def test_closed_reader_refuses_and_owned_handle_is_released(hf_file):
    path, _ = hf_file

    async def main():
        r = await SliceReader.open(path)
        await r.aclose()
        await r.aclose()  # idempotent
        with pytest.raises(dsio.ClosedError):
            await r.read([TensorSlice("step", torch.empty(1, dtype=torch.int64))])
        return r._handle.closed

    fds = len(os.listdir("/proc/self/fd"))
    assert _run(main()) is True
    assert len(os.listdir("/proc/self/fd")) == fds


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu
def test_cuda_destination(hf_file):
    path, t = hf_file
    out = torch.empty(3000, device="cuda")
    _run(read_slices(path, [TensorSlice("wte.weight", out, 11)]))
    assert torch.equal(out.cpu(), t["wte.weight"].reshape(-1)[11:3011])


def test_a_cancelled_read_leaves_no_slice_reading(data_dir):
    # read() raises only once every slice's reads ended, cancellation included: nothing is left
    # writing into a destination the caller may free as soon as the CancelledError reaches it
    path = os.path.join(data_dir, "big.safetensors")
    big = {f"t{i}": torch.randn(2 << 20, generator=torch.Generator().manual_seed(i)) for i in range(8)}
    save_file(big, path)  # 8 x 8 MiB

    async def main():
        async with (
            dsio.AsyncIOHandle(dsio.checkpoint.DEFAULT_IO) as h,
            await SliceReader.open(path, handle=h) as r,
        ):
            outs = [torch.empty(2 << 20) for _ in big]
            task = asyncio.ensure_future(r.read([TensorSlice(n, o) for n, o in zip(big, outs)]))
            while h.statistics().engine.in_flight == 0 and not task.done():
                await asyncio.sleep(0)
            assert not task.done(), "the reads finished before the test could cancel them"
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            reading = [
                t for t in asyncio.all_tasks() if not t.done() and "SliceReader._one" in repr(t.get_coro())
            ]
            return reading, h.statistics().engine.in_flight

    reading, in_flight = _run(main())
    assert reading == [] and in_flight == 0
