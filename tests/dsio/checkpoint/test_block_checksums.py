"""Block checksums: every writer records the crc32c of each 1 MiB block of a big tensor, and a read of
part of a stored tensor (a rank resharding another rank's file reads only its slice) checks the
blocks it touches before it hands out a byte: a flipped bit inside the slice is a ChecksumError, one
outside it is not read. Files without block checksums still load (whole-tensor checks)."""

from __future__ import annotations

import asyncio
import json
import os
import struct

import crc32c
import pytest
import torch
from ckpt_helpers import flip_byte

pytest.importorskip("dsio._C", reason="dsio's native core is not built here")

import dsio.checkpoint as C  # noqa: E402
from dsio.checkpoint import FileRegions, StoredTensor  # noqa: E402
from dsio.checkpoint._format import encode_header, parse_header  # noqa: E402
from dsio.checkpoint._integrity import BLOCK_BYTES, BLOCK_BYTES_KEY, BLOCKS_KEY  # noqa: E402
from dsio.handle import AsyncIOHandle  # noqa: E402

BIG = (3 * BLOCK_BYTES + 12_345) // 4  # elements: four blocks, the last one short


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"big": torch.randn(BIG, generator=g), "small": torch.arange(10, dtype=torch.int16), "n": 1}


def _header(path: str) -> tuple[dict, int]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), 8 + n


def _expected_blocks(t: torch.Tensor) -> str:
    raw = t.numpy().tobytes()
    return "".join(f"{crc32c.crc32c(raw[i : i + BLOCK_BYTES]):08x}" for i in range(0, len(raw), BLOCK_BYTES))


@pytest.mark.parametrize("writer", ["staged", "one-shot", "streamed"])
def test_every_writer_records_the_blocks_of_a_big_tensor(tmp_path, writer: str) -> None:
    state = _state()
    path = str(tmp_path / "f.safetensors")

    async def go() -> None:
        if writer == "one-shot":
            await C.save(state, path)
            return
        s = dict(state)
        if writer == "streamed":  # a lazy source: the windowed writer
            src = tmp_path / "src.bin"
            src.write_bytes(state["big"].numpy().tobytes())
            s["big"] = FileRegions([(src, 0, state["big"].nbytes)], torch.float32, (BIG,))
        async with C.Checkpointer(tmp_path / "ck") as ck:
            await (await ck.save(1, s))
        os.replace(tmp_path / "ck" / "step-000000001" / "rank-00000.safetensors", path)

    asyncio.run(go())
    header, _ = _header(path)
    meta = header["__metadata__"]
    assert json.loads(meta[BLOCKS_KEY]) == {"big": _expected_blocks(state["big"])}  # small: its own crc
    assert meta[BLOCK_BYTES_KEY] == str(BLOCK_BYTES)
    whole = json.loads(meta["dsio.crc32c"])["big"]
    assert whole == f"{crc32c.crc32c(state['big'].numpy().tobytes()):08x}"  # joined from the blocks


async def _read(path: str, offset: int, n: int) -> torch.Tensor:
    async with AsyncIOHandle(C.DEFAULT_IO) as io:
        big = (await C.load(path, handle=io, lazy_from=1))["big"]
        assert isinstance(big, StoredTensor)
        out = torch.full((n,), 7, dtype=torch.uint8)
        await big.read_into(io, offset, out)
        return out


def _saved(tmp_path) -> tuple[str, torch.Tensor, int]:
    state = _state()
    path = str(tmp_path / "f.safetensors")
    asyncio.run(C.save(state, path))
    _, data_start = _header(path)
    return path, state["big"].view(torch.uint8), data_start  # big is first in the data section


@pytest.mark.parametrize(
    "offset,n",
    [
        (2 * BLOCK_BYTES + 100, 1000),  # inside block 2, over the flipped byte
        (2 * BLOCK_BYTES + 1000, 100),  # inside block 2, past it: the whole block is checked
        (BLOCK_BYTES - 10, 2 * BLOCK_BYTES + 20),  # edges of blocks 0 and 3, blocks 1 and 2 whole
        (2 * BLOCK_BYTES, BLOCK_BYTES),  # exactly block 2
    ],
)
def test_a_flipped_byte_inside_a_partial_read_is_a_checksum_error(tmp_path, offset: int, n: int) -> None:
    path, raw, ds = _saved(tmp_path)
    assert torch.equal(asyncio.run(_read(path, offset, n)), raw[offset : offset + n])  # intact: exact
    flip = 2 * BLOCK_BYTES + 777  # in block 2
    flip_byte(path, ds + flip, 0x04)
    with pytest.raises(C.ChecksumError):
        asyncio.run(_read(path, offset, n))


def test_a_partial_read_away_from_the_flipped_block_reads_true_bytes(tmp_path) -> None:
    path, raw, ds = _saved(tmp_path)
    flip_byte(path, ds + 2 * BLOCK_BYTES + 5, 0x04)
    got = asyncio.run(_read(path, 100, BLOCK_BYTES))  # blocks 0 and 1 only
    assert torch.equal(got, raw[100 : 100 + BLOCK_BYTES])

    async def verify() -> None:  # verify() checks the blocks not read yet
        async with AsyncIOHandle(C.DEFAULT_IO) as io:
            big = (await C.load(path, handle=io, lazy_from=1))["big"]
            await big.read_into(io, 0, torch.empty(10, dtype=torch.uint8))
            assert not big.verified
            await big.verify()

    with pytest.raises(C.ChecksumError):
        asyncio.run(verify())


def test_a_file_without_block_checksums_still_loads(tmp_path) -> None:
    # written before dsio recorded blocks: the same file with the two keys taken out (header resealed)
    path, raw, ds = _saved(tmp_path)
    with open(path, "rb") as f:
        data = f.read()
    header = parse_header(data[8:ds], len(data), path)
    meta = {k: v for k, v in header.metadata.items() if k not in (BLOCKS_KEY, BLOCK_BYTES_KEY)}
    old = encode_header(header.entries, meta)
    assert len(old) == ds
    with open(path, "wb") as f:
        f.write(old + data[ds:])
    whole = asyncio.run(C.load(path))
    assert torch.equal(whole["big"].view(torch.uint8), raw)
    assert torch.equal(
        asyncio.run(_read(path, BLOCK_BYTES + 3, 500)), raw[BLOCK_BYTES + 3 : BLOCK_BYTES + 503]
    )
    flip_byte(path, ds + 5, 0x04)
    with pytest.raises(C.ChecksumError):  # a whole read is still checked
        asyncio.run(C.load(path))
