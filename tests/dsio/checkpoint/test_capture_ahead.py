"""An async streamed save captures in-memory bytes training can change without waiting for the disk:
windows holding only such bytes get buffers of their own beyond the streaming windows, so
``Capture.volatile`` (what a training step waits on) resolves while the file's writes are still held
back. Lazy sources (swap files, a master in its file) never get extra windows: their memory stays
bounded by the streaming windows."""

from __future__ import annotations

import asyncio

import pytest
import torch

pytest.importorskip("dsio._C", reason="dsio's native core is not built here")

import dsio.checkpoint as C  # noqa: E402
from dsio.checkpoint import MemorySpan, _stream  # noqa: E402
from dsio.file import AsyncFile  # noqa: E402

CHUNK = 16 << 10
N = 64 * 1024  # float32 elements: 16 windows per tensor (the streaming windows are 3)


class Stable(C.FileRegions):
    stable = True


def _hold_writes(monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
    """Every file write of the save waits until the returned event is set."""
    gate = asyncio.Event()
    original = AsyncFile.pwrite

    async def held(self: AsyncFile, tensor: torch.Tensor, offset: int = 0) -> int:
        await gate.wait()
        return await original(self, tensor, offset)

    monkeypatch.setattr(AsyncFile, "pwrite", held)
    return gate


def _state(tmp_path, stable: bool):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(1)
    master, m = torch.randn(N, generator=g), torch.randn(N, generator=g)
    path = str(tmp_path / "swap.bin")
    m.numpy().tofile(path)
    kind = Stable if stable else C.FileRegions
    src = kind([(path, 0, N * 4)], torch.float32, (N,))
    order = [[MemorySpan.of(master[k * N // 4 : (k + 1) * N // 4])] for k in range(4)]
    return {"a_exp_avg": src, "b_master": master}, order, master, m


def test_in_memory_bytes_are_captured_while_writes_are_held(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(_stream, "STREAM_CHUNK_BYTES", CHUNK)
    gate = _hold_writes(monkeypatch)

    async def go() -> tuple[bool, object, object]:
        state, order, _, _ = _state(tmp_path, stable=True)
        async with C.Checkpointer(tmp_path / "ck") as ck:
            task = await ck.save(1, state, background_staging=True, touch_order=order)
            capture = ck.staging_capture
            await asyncio.wait_for(asyncio.wrap_future(capture.volatile), 30)
            sets = all(f.done() for f in capture.futures)
            gate.set()
            await task
            return sets, ck.statistics(), await ck.load(1)

    sets, stats, out = asyncio.run(go())
    _, _, master, m = _state(tmp_path, stable=True)
    assert sets
    assert torch.equal(out["b_master"], master) and torch.equal(out["a_exp_avg"], m)  # type: ignore[index]
    # each of the master's 16 windows got a buffer (3 fixed + 13 extra) and no more: the stable
    # source then streamed through buffers freed by written windows
    assert stats.last_stream_buffer_bytes == 16 * CHUNK  # type: ignore[attr-defined]


def test_lazy_sources_never_get_extra_windows(tmp_path, monkeypatch) -> None:
    """A non-stable lazy source is volatile too (training may rewrite its file), but its bytes come
    from the disk: it streams through the fixed windows, so ``volatile`` waits for the writes."""
    monkeypatch.setattr(_stream, "STREAM_CHUNK_BYTES", CHUNK)
    gate = _hold_writes(monkeypatch)

    async def go() -> tuple[bool, object, object]:
        state, order, _, _ = _state(tmp_path, stable=False)
        async with C.Checkpointer(tmp_path / "ck") as ck:
            task = await ck.save(1, state, background_staging=True, touch_order=order)
            capture = ck.staging_capture
            await asyncio.sleep(0.5)
            early = capture.volatile.done()
            gate.set()
            await task
            return early, ck.statistics(), await ck.load(1)

    early, stats, out = asyncio.run(go())
    _, _, master, m = _state(tmp_path, stable=False)
    assert not early
    assert torch.equal(out["b_master"], master) and torch.equal(out["a_exp_avg"], m)  # type: ignore[index]
    # the master's windows may take extra buffers; the lazy source's 16 windows may not
    assert stats.last_stream_buffer_bytes <= (16 + _stream.STREAM_BUFFERS) * CHUNK  # type: ignore[attr-defined]


def test_capture_bytes_zero_keeps_the_fixed_windows(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(_stream, "STREAM_CHUNK_BYTES", CHUNK)
    state, order, master, m = _state(tmp_path, stable=True)
    counters: dict[str, int] = {}
    real = _stream.write_streamed

    async def limited(*a, **k):  # type: ignore[no-untyped-def]
        k["capture_bytes"] = 0
        k["counters"] = counters
        return await real(*a, **k)

    monkeypatch.setattr("dsio.checkpoint._write.write_streamed", limited)

    async def go() -> object:
        async with C.Checkpointer(tmp_path / "ck") as ck:
            task = await ck.save(1, state, background_staging=True, touch_order=order)
            await task
            return await ck.load(1)

    out = asyncio.run(go())
    assert counters == {"window_bytes": _stream.STREAM_BUFFERS * CHUNK, "extra_windows": 0}
    assert torch.equal(out["b_master"], master) and torch.equal(out["a_exp_avg"], m)  # type: ignore[index]


def test_stable_windows_wait_for_volatile_ones_and_a_failed_volatile_window_does_not_hang(
    tmp_path, monkeypatch
) -> None:
    """Stable windows start reading only once every volatile window is filled; when a volatile
    window fails instead (its file is gone), the save fails promptly instead of leaving the stable
    windows waiting."""
    monkeypatch.setattr(_stream, "STREAM_CHUNK_BYTES", CHUNK)
    state, order, _, _ = _state(tmp_path, stable=True)
    order_seen: list[str] = []
    stable_read = Stable.read_into

    async def traced(self, io, offset, out):  # type: ignore[no-untyped-def]
        order_seen.append("stable")
        await stable_read(self, io, offset, out)

    monkeypatch.setattr(Stable, "read_into", traced)

    class Failing(C.FileRegions):
        """Volatile (not stable) and lazy: fails its read late, once the stable windows got
        buffers freed by the master's written windows."""

        async def read_into(self, io, offset, out):  # type: ignore[no-untyped-def]
            await asyncio.sleep(0.5)
            raise OSError(5, "injected read error")

    broken = Failing([(str(tmp_path / "swap.bin"), 0, 1024 * 4)], torch.float32, (1024,))

    async def go(st) -> tuple[object, bool]:  # type: ignore[no-untyped-def]
        async with C.Checkpointer(tmp_path / f"ck{len(st)}") as ck:
            task = await ck.save(1, st, background_staging=True, touch_order=order)
            try:
                await asyncio.wait_for(task, 30)
            except TimeoutError:
                return "hung", False
            except Exception as e:  # noqa: BLE001
                return e, ck.staging_capture.volatile.done()
            return None, ck.staging_capture.volatile.done()

    err, _ = asyncio.run(go(state))
    assert err is None and order_seen  # the stable source was read, after the master's windows
    order_seen.clear()
    err, volatile_done = asyncio.run(go({**state, "c_broken": broken}))
    assert isinstance(err, OSError) and volatile_done
