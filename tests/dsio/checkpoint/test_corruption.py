"""Corrupt files never load as wrong data: flipped bytes, truncation, trailing bytes, bad headers."""

from __future__ import annotations

import asyncio
import os
import random
import struct

import pytest
import torch
from ckpt_helpers import flip_byte

import dsio
import dsio.checkpoint as C

BAD = (dsio.ChecksumError, dsio.errors.CheckpointFormatError)


def run(coro):
    return asyncio.run(coro)


def _state():
    g = torch.Generator().manual_seed(0)
    return {
        "big": torch.randn(3 << 18, generator=g),  # read straight into place
        "small": torch.randn(100, generator=g),  # read in a run
        "half": torch.randn(33, dtype=torch.float32, generator=g).half(),
        "meta": {"lr": 0.001, "step": 7, "names": ["a", "b"]},
    }


@pytest.fixture
def ckpt(tmp_path) -> str:
    path = str(tmp_path / "c.safetensors")
    run(C.save(_state(), path))
    return path


def _data_start(path: str) -> int:
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


@pytest.mark.parametrize("which", ["big", "small", "half"])
def test_flipped_data_byte_is_checksum_error_naming_tensor_and_file(ckpt, which):
    hdr = C.load  # noqa: F841  (the header tells where each tensor lives)
    import safetensors

    with safetensors.safe_open(ckpt, "pt") as f:
        names = list(f.keys())
    assert which in names
    import json

    with open(ckpt, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    begin, end = header[which]["data_offsets"]
    flip_byte(ckpt, _data_start(ckpt) + (begin + end) // 2)
    with pytest.raises(dsio.ChecksumError) as ei:
        run(C.load(ckpt))
    assert which in str(ei.value) and ckpt in str(ei.value)
    # verify=False is the caller's explicit choice to skip the check.
    run(C.load(ckpt, verify=False))


def test_flipped_bytes_anywhere_never_give_wrong_data(ckpt, tmp_path):
    size = os.path.getsize(ckpt)
    ds = _data_start(ckpt)
    with open(ckpt, "rb") as f:
        orig = f.read()
    rng = random.Random(0)
    # Every byte of the real header, random padding bytes, random data bytes.
    hdr_len = len(orig[8:ds].rstrip(b" ")) + 8
    positions = list(range(hdr_len)) + rng.sample(range(hdr_len, ds), 20) + rng.sample(range(ds, size), 40)

    async def main():
        async with dsio.AsyncIOHandle(C.DEFAULT_IO) as h:
            for pos in positions:
                data = bytearray(orig)
                data[pos] ^= 1 << rng.randrange(8)
                p = str(tmp_path / "f.safetensors")
                with open(p, "wb") as f:
                    f.write(data)
                with pytest.raises(BAD):
                    await C.load(p, handle=h)

    run(main())


@pytest.mark.parametrize("cut", [0, 5, 100, 4096, -1, -4096])
def test_truncated_file_is_a_clear_error(ckpt, cut):
    size = os.path.getsize(ckpt)
    os.truncate(ckpt, cut if cut >= 0 else size + cut)
    with pytest.raises(dsio.errors.CheckpointFormatError):
        run(C.load(ckpt))


def test_trailing_bytes_are_rejected(ckpt):
    with open(ckpt, "ab") as f:
        f.write(b"\0" * 10)
    with pytest.raises(dsio.errors.CheckpointFormatError):
        run(C.load(ckpt))


def test_truncated_rank_file_in_a_checkpointer(tmp_path):
    async def main():
        async with C.Checkpointer(tmp_path) as ck:
            await (await ck.save(1, _state()))
            f = tmp_path / "step-000000001" / "rank-00000.safetensors"
            os.truncate(f, os.path.getsize(f) - 1)
            with pytest.raises(dsio.errors.CheckpointFormatError):
                await ck.load()

    run(main())


def test_flipped_byte_in_a_checkpointer(tmp_path):
    async def main():
        async with C.Checkpointer(tmp_path) as ck:
            await (await ck.save(1, _state()))
            f = str(tmp_path / "step-000000001" / "rank-00000.safetensors")
            flip_byte(f, os.path.getsize(f) - 3)
            with pytest.raises(dsio.ChecksumError):
                await ck.load()

    run(main())


def test_header_length_pointing_past_the_end(tmp_path):
    p = str(tmp_path / "h.safetensors")
    with open(p, "wb") as f:
        f.write(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(dsio.errors.CheckpointFormatError):
        run(C.load(p))


@pytest.mark.parametrize(
    "header",
    [
        b'{"x":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}',  # span disagrees with shape
        b'{"x":{"dtype":"F99","shape":[1],"data_offsets":[0,4]}}',  # unknown dtype
        b'{"x":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}',  # gap at start
        b'{"x":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}',  # negative dim
        b"[1,2]",
        b"not json",
        b'{"__metadata__":{"a":1}}',
    ],
)
def test_malformed_headers(tmp_path, header):
    p = str(tmp_path / "m.safetensors")
    with open(p, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + b"\0" * 8)
    with pytest.raises(dsio.errors.CheckpointFormatError):
        run(C.load(p))
