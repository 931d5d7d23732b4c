"""Checkpointer.save's contract with its caller: ``save()`` returns before the state is copied; the caller
changes nothing until ``wait_staged()`` returns; a change it makes before then is detected, never stored.

The copier is slowed down (each segment of the staging copy sleeps first), so that staging really is
still running when the test changes the state: without the slowdown the copy of a small state could
finish before the change and hide a broken ``wait_staged``.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import crc32c
import pytest
import safetensors
import torch

import dsio.checkpoint as C
from dsio.checkpoint import _write


@pytest.fixture
def slow_copier(monkeypatch):
    """Segments of 256 KiB, each copy 3 ms late; writes submitted every 512 KiB staged."""
    real = _write._copy_and_crc

    def slow(*args: int) -> list[tuple[int, int, int]]:
        time.sleep(0.003)
        return real(*args)

    monkeypatch.setattr(_write, "_copy_and_crc", slow)
    monkeypatch.setattr(_write, "SEGMENT_BYTES", 256 << 10)
    monkeypatch.setattr(_write, "CHUNK_BYTES", 512 << 10)


def _state() -> dict:
    g = torch.Generator().manual_seed(7)
    return {
        "model": {f"w{i}": torch.randn(300 + i, 257, generator=g) for i in range(8)},  # ~2.5 MB, odd sizes
        "bias": torch.randn(3, generator=g),
        "step": 5,
    }


def _snapshot(state: dict) -> dict:
    return {"model": {k: v.clone() for k, v in state["model"].items()}, "bias": state["bias"].clone()}


def _scribble(state: dict) -> None:
    for t in state["model"].values():
        t.fill_(-1.0)
    state["bias"].zero_()


def test_save_returns_before_the_copy_and_changes_after_wait_staged_never_reach_the_file(
    tmp_path, slow_copier
) -> None:
    async def main() -> None:
        state = _state()
        before = _snapshot(state)
        async with C.Checkpointer(tmp_path) as ck:
            task = await ck.save(1, state)
            assert not ck.staging_capture.over.done()  # returned before copying anything
            await ck.wait_staged()
            _scribble(state)  # allowed from here on
            res = await task
            back = await ck.load()  # crc32c verified
        for k, v in before["model"].items():
            assert torch.equal(back["model"][k], v), k
        assert torch.equal(back["bias"], before["bias"]) and back["step"] == 5
        # the checksums the copier threads computed piece by piece equal crc32c of each whole tensor
        path = os.path.join(res.path, "rank-00000.safetensors")
        with safetensors.safe_open(path, "pt") as f:
            sums = json.loads(f.metadata()["dsio.crc32c"])
        for k, v in before["model"].items():
            assert int(sums[f"model/{k}"], 16) == crc32c.crc32c(v.numpy().tobytes()), k

    asyncio.run(main())


@pytest.mark.parametrize("when", ["before_the_copy_starts", "while_copying", "only_a_view"])
def test_a_change_before_wait_staged_fails_the_save_and_commits_nothing(tmp_path, slow_copier, when) -> None:
    async def main() -> None:
        state = _state()
        async with C.Checkpointer(tmp_path) as ck:
            await (await ck.save(1, {"w": torch.ones(4)}))  # a committed step to keep
            task = await ck.save(2, state)
            if when == "while_copying":
                await asyncio.sleep(0.01)
                assert not ck.staging_capture.over.done()
                state["model"]["w6"].mul_(2)
            elif when == "only_a_view":  # a view shares its base's version counter
                state["model"]["w3"][10:20, 1].add_(1)
            else:
                state["bias"].add_(1)
            with pytest.raises(C.StateChangedError) as ei:
                await task
            changed = {"while_copying": "model/w6", "only_a_view": "model/w3"}.get(when, "bias")
            assert ei.value.names == [changed] and ei.value.step == 2
            assert ck.steps() == [1] and ck.latest_step() == 1
            assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
            # the next save, made correctly, commits
            await (await ck.save(3, state))
            assert ck.steps() == [1, 3]

    asyncio.run(main())


def test_without_background_staging_the_state_is_free_when_save_returns(tmp_path, slow_copier) -> None:
    async def main() -> None:
        state = _state()
        before = _snapshot(state)
        async with C.Checkpointer(tmp_path) as ck:
            task = await ck.save(1, state, background_staging=False)
            assert ck.staging_capture.over.done()
            _scribble(state)
            await task
            back = await ck.load()
        for k, v in before["model"].items():
            assert torch.equal(back["model"][k], v), k

    asyncio.run(main())


@pytest.mark.parametrize("where", [None, "first_piece", "middle_piece", "last_byte"])
def test_a_big_tensor_is_verified_piece_by_piece_as_it_is_read(tmp_path, monkeypatch, where) -> None:
    """Loads read a big tensor in pieces and checksum each as it lands; the joined checksum must still
    catch one flipped byte anywhere (and pass a clean file)."""
    from dsio.checkpoint import _read

    monkeypatch.setattr(_read, "PIECE_BYTES", 64 << 10)
    g = torch.Generator().manual_seed(3)
    big = torch.randn(300_001, generator=g)  # 1.2 MB: 19 pieces, the tensor starts mid-page
    state = {"a": torch.randn(5, generator=g), "big": big}

    async def main() -> None:
        async with C.Checkpointer(tmp_path) as ck:
            res = await (await ck.save(1, state))
            path = os.path.join(res.path, "rank-00000.safetensors")
            if where is not None:
                with open(path, "rb") as f:
                    header_len = int.from_bytes(f.read(8), "little")
                    header = json.loads(f.read(header_len))
                begin = 8 + header_len + header["big"]["data_offsets"][0]
                off = {"first_piece": 10, "middle_piece": 700_000, "last_byte": big.numel() * 4 - 1}[where]
                with open(path, "r+b") as f:
                    f.seek(begin + off)
                    b = f.read(1)
                    f.seek(begin + off)
                    f.write(bytes([b[0] ^ 0x40]))
                with pytest.raises(C.ChecksumError):
                    await ck.load()
            else:
                back = await ck.load()
                assert torch.equal(back["big"], big) and torch.equal(back["a"], state["a"])

    asyncio.run(main())


def test_blocks_are_reserved_while_the_first_tensors_are_copied_and_before_any_write(tmp_path, monkeypatch):
    """posix_fallocate overlaps the first copies (it is off the save's critical path), and no byte
    reaches the file before its blocks are reserved (a full disk fails before any write)."""
    import threading

    from dsio.file import AsyncFile

    events: list[tuple[str, bool]] = []
    copied = threading.Event()
    real_copy, real_pre, real_pwrite = _write._copy_and_crc, _write._preallocate, AsyncFile.pwrite

    def copy(*a):
        out = real_copy(*a)
        copied.set()
        return out

    def preallocate(path, size):
        events.append(("a copy ran before the reserve ended", copied.wait(10)))
        real_pre(path, size)
        events.append(("reserved", True))

    async def pwrite(self, tensor, offset=0):
        events.append(("write", True))
        return await real_pwrite(self, tensor, offset)

    monkeypatch.setattr(_write, "_copy_and_crc", copy)
    monkeypatch.setattr(_write, "_preallocate", preallocate)
    monkeypatch.setattr(AsyncFile, "pwrite", pwrite)
    state = {"w": torch.randn(3 << 20), "b": torch.randn(7)}  # 12 MiB: two copy segments

    async def main() -> None:
        async with C.Checkpointer(tmp_path) as ck:
            await (await ck.save(1, state))
            back = await ck.load()
        assert torch.equal(back["w"], state["w"]) and torch.equal(back["b"], state["b"])

    asyncio.run(main())
    assert events[0] == ("a copy ran before the reserve ended", True)
    names = [n for n, _ in events]
    assert names.index("reserved") < names.index("write")
