"""Streamed loads: ``Checkpointer.load(lazy_from=N)`` leaves big tensors in the file as `StoredTensor`s,
read piece by piece with their checksums checked on the way; a corrupted byte is a ChecksumError
whether the consumer reads in order or only `verify`s; the file stays open until they are gone."""

from __future__ import annotations

import asyncio
import gc
import os

import pytest
import torch

pytest.importorskip("dsio._C", reason="dsio's native core is not built here")

import contextlib

import dsio.checkpoint as C  # noqa: E402
from dsio.checkpoint import StoredTensor  # noqa: E402

BIG = 300_000  # elements (1.2 MB): left in the file with lazy_from=1 MiB


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"big": torch.randn(BIG, generator=g), "small": torch.arange(100), "n": 5}


async def _save(root: str, state: dict) -> None:
    async with C.Checkpointer(root) as ck:
        await (await ck.save(1, state))


def _corrupt(root: str, tensor: torch.Tensor) -> None:
    path = os.path.join(root, "step-000000001", "rank-00000.safetensors")
    with open(path, "rb") as f:
        data = f.read()
    at = data.index(tensor[BIG // 2 : BIG // 2 + 4].numpy().tobytes())
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(bytes(b ^ 0xFF for b in data[at : at + 4]))


def test_pieces_read_in_order_are_verified_and_exact(tmp_path) -> None:
    state = _state()
    root = str(tmp_path / "ck")

    async def go() -> tuple[bool, torch.Tensor, int]:
        await _save(root, state)
        async with C.Checkpointer(root) as ck:
            out = await ck.load(lazy_from=1 << 20)
            big = out["big"]
            assert isinstance(big, StoredTensor) and isinstance(out["small"], torch.Tensor)
            assert big.shape == (BIG,) and big.dtype == torch.float32
            got = torch.empty(BIG, dtype=torch.float32)
            raw = got.view(torch.uint8)
            step = 100_003  # pieces of odd sizes, in order
            for a in range(0, raw.numel(), step):
                await big.read_into(ck._io(), a, raw[a : a + step])
            return big.verified, got, out["n"]

    verified, got, n = asyncio.run(go())
    assert verified and n == 5
    assert torch.equal(got, state["big"])


@pytest.mark.parametrize("how", ["in_order", "verify_only", "materialize"])
def test_a_corrupted_byte_is_a_checksum_error(tmp_path, how: str) -> None:
    state = _state()
    root = str(tmp_path / "ck")
    asyncio.run(_save(root, state))
    _corrupt(root, state["big"])

    async def go() -> None:
        async with C.Checkpointer(root) as ck:
            big = (await ck.load(lazy_from=1 << 20))["big"]
            io = ck._io()
            if how == "in_order":
                out = torch.empty(big.nbytes, dtype=torch.uint8)
                for a in range(0, big.nbytes, 1 << 18):
                    await big.read_into(io, a, out[a : a + (1 << 18)])
            elif how == "verify_only":
                await big.read_into(io, 4096, torch.empty(64, dtype=torch.uint8))  # out of order
                assert not big.verified
                await big.verify()
            else:
                await big.materialize(io)

    with pytest.raises(C.ChecksumError):
        asyncio.run(go())


def test_the_file_stays_open_until_the_stored_tensors_are_gone(tmp_path) -> None:
    root = str(tmp_path / "ck")
    asyncio.run(_save(root, _state()))

    rank_file = os.path.realpath(os.path.join(root, "step-000000001", "rank-00000.safetensors"))

    def fds() -> int:  # descriptors of this process open on the rank file
        n = 0
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                n += os.readlink(f"/proc/self/fd/{fd}") == rank_file
        return n

    async def go() -> int:
        async with C.Checkpointer(root) as ck:
            plain = await ck.load()  # the handle is created; nothing lazy: nothing held
            assert isinstance(plain["big"], torch.Tensor)
            base = fds()
            assert base == 0
            out = await ck.load(lazy_from=1 << 20)
            held = fds() - base
            del out
            gc.collect()
            assert fds() == base
            return held

    assert asyncio.run(go()) == 1
    with pytest.raises(ValueError):
        asyncio.run(_lazy_on_device(root))


async def _lazy_on_device(root: str) -> None:
    async with C.Checkpointer(root) as ck:
        await ck.load(lazy_from=1, device="meta")
