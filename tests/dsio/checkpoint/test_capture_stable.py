"""Stable lazy sources (bytes their owner cannot change while a save reads them, e.g. swap-file
versions pinned copy-on-write): no touch set waits for them, their windows are streamed after every
window holding bytes the owner can change, and ``Capture.volatile`` resolves once those are in."""

from __future__ import annotations

import asyncio

import pytest
import torch

pytest.importorskip("dsio._C", reason="dsio's native core is not built here")

import dsio.checkpoint as C  # noqa: E402
from dsio.checkpoint import FileSpan, MemorySpan, _stream  # noqa: E402
from dsio.checkpoint._capture import Capture, plan_windows  # noqa: E402
from dsio.checkpoint._format import layout  # noqa: E402

CHUNK = 16 << 10
PIECE = 8192  # float32 elements per "sub-group": two windows


class Pinned(C.FileRegions):
    """A file source that is stable, and slow: every read waits for ``gate`` (set by the test)."""

    stable = True

    def __init__(self, *a: object, gate: asyncio.Event | None = None) -> None:
        super().__init__(*a)  # type: ignore[arg-type]
        self.gate = gate
        self.reads = 0

    async def read_into(self, io, offset: int, out: torch.Tensor) -> None:  # type: ignore[no-untyped-def]
        if self.gate is not None:
            await self.gate.wait()
        self.reads += 1
        await super().read_into(io, offset, out)


def _state(tmp_path, n_sub: int = 4, gate: asyncio.Event | None = None):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(0)
    master, m = torch.randn(n_sub * PIECE, generator=g), torch.randn(n_sub * PIECE, generator=g)
    path = str(tmp_path / "swap.bin")
    m.numpy().tofile(path)
    regions = [(path, k * PIECE * 4, PIECE * 4) for k in range(n_sub)]
    # the stable tensor first in the file: file order would read it before the master
    src = Pinned(regions, torch.float32, (m.numel(),), gate=gate)
    order = [
        [FileSpan(*regions[k]), MemorySpan.of(master[k * PIECE : (k + 1) * PIECE])] for k in range(n_sub)
    ]
    return {"a_exp_avg": src, "b_master": master}, order, master, m


def test_plan_puts_volatile_windows_first_and_no_set_on_stable_bytes(tmp_path) -> None:
    state, order, master, _ = _state(tmp_path)
    sources = dict(state)
    entries = layout((n, t.dtype, tuple(t.shape)) for n, t in sources.items())
    data = entries[-1].end
    plan = plan_windows(entries, sources, CHUNK, data, order)
    per_tensor = master.numel() * 4 // CHUNK
    stable = list(range(per_tensor))  # a_exp_avg's windows
    volatile = list(range(per_tensor, 2 * per_tensor))
    assert plan.order == volatile + stable  # touch sets only reach the master's windows
    assert plan.remaining == [2] * len(order)  # the FileSpan of a stable source adds nothing
    assert plan.volatile == [False] * per_tensor + [True] * per_tensor
    assert plan.volatile_left == per_tensor
    # no touch order: still the volatile windows first
    assert plan_windows(entries, sources, CHUNK, data, None).order == volatile + stable
    # the same source without ``stable``: file order again, and the sets reach its windows
    plain = {"a_exp_avg": C.FileRegions(state["a_exp_avg"].regions, torch.float32, (master.numel(),))}
    sources = {**plain, "b_master": master}
    plan = plan_windows(entries, sources, CHUNK, data, None)
    assert plan.order == list(range(2 * per_tensor)) and plan.volatile_left == 2 * per_tensor
    assert plan_windows(entries, sources, CHUNK, data, order).remaining == [4] * len(order)


def test_volatile_resolves_while_stable_bytes_still_stream(tmp_path, monkeypatch) -> None:
    """Every touch set and ``volatile`` resolve while the stable source's reads are held back; the
    file written once they are let go is exact; ``over`` and `when_over` fire at the end."""
    monkeypatch.setattr(_stream, "STREAM_CHUNK_BYTES", CHUNK)

    async def go() -> tuple[bool, bool, int, list[str], object]:
        gate = asyncio.Event()
        state, order, _, _ = _state(tmp_path, gate=gate)
        events: list[str] = []
        async with C.Checkpointer(tmp_path / "ck") as ck:
            task = await ck.save(1, state, background_staging=True, touch_order=order)
            capture = ck.staging_capture
            capture.when_over(lambda: events.append("over"))
            await asyncio.wait_for(asyncio.wrap_future(capture.volatile), 30)
            sets_done = all(f.done() for f in capture.futures)
            over_early = capture.over.done()
            reads_before = state["a_exp_avg"].reads
            gate.set()
            await task
            assert capture.over.done()
            return sets_done, over_early, reads_before, events, await ck.load(1)

    sets_done, over_early, reads_before, events, out = asyncio.run(go())
    _, _, master, m = _state(tmp_path)
    assert sets_done and not over_early and reads_before == 0
    assert events == ["over"]
    assert torch.equal(out["b_master"], master) and torch.equal(out["a_exp_avg"], m)  # type: ignore[index]


def test_over_resolves_and_callbacks_run_when_staging_fails(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(_stream, "STREAM_CHUNK_BYTES", CHUNK)
    state, order, _, _ = _state(tmp_path)
    (tmp_path / "swap.bin").unlink()  # the stable source cannot be read
    events: list[str] = []

    async def go() -> BaseException | None:
        async with C.Checkpointer(tmp_path / "ck") as ck:
            task = await ck.save(1, state, background_staging=True, touch_order=order)
            ck.staging_capture.when_over(lambda: events.append("over"))
            try:
                await task
            except Exception as e:
                return e
            return None

    assert isinstance(asyncio.run(go()), OSError)
    assert events == ["over"]


def test_when_over_after_the_fact_runs_at_once() -> None:
    cap = Capture(2)
    cap.resolve_all()
    ran: list[int] = []
    cap.when_over(lambda: ran.append(1))
    assert ran == [1] and cap.volatile.done() and all(f.done() for f in cap.futures)
