"""Async saves of NVMe-offloaded Adam state pin the swap file's slot versions (copy-on-write): the
next optimizer steps write around them, so training never waits for the save to read the swapped
state, and the checkpoint still holds exactly the state of the step it was taken at. Pins are
released on every path (success, failure, torch.save fallback), so the swap file stops growing."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import torch
from _dstrain_helpers import engine_losses, make_model
from _offload_helpers import offload_config

pytest.importorskip("dsio._C", reason="dsio's native core is not built here")

import dstrain  # noqa: E402
from dsio._bridge import run_sync  # noqa: E402
from dsio.checkpoint import Checkpointer, _stream  # noqa: E402
from dstrain.checkpoint.sources import SwapRegions  # noqa: E402
from dstrain.offload.swap.slots import SlotTable  # noqa: E402

DIM = 96  # ~60k parameters: ~15 sub-groups of 4096 elements


@pytest.fixture
def held_reads(monkeypatch, one_thread):
    """Small windows; once a save has captured everything training can change, its further reads
    of pinned swap versions wait until the test lets them go (``release()``) -- a step that waited
    for them would never finish (the held reads give up after 60 s and fail the save)."""
    monkeypatch.setattr(_stream, "STREAM_CHUNK_BYTES", 16 << 10)
    go = threading.Event()
    box: dict[str, Any] = {"capture": None, "held": 0}
    read = SwapRegions.read_into

    async def held(self: SwapRegions, io: Any, offset: int, out: torch.Tensor) -> None:
        capture = box["capture"]
        if self.stable and capture is not None and capture.volatile.done() and not go.is_set():
            box["held"] += 1
            for _ in range(6000):
                if go.is_set():
                    break
                await asyncio.sleep(0.01)
            else:
                raise TimeoutError("held swap read was never let go")
        await read(self, io, offset, out)

    monkeypatch.setattr(SwapRegions, "read_into", held)
    box["release"] = go.set
    return box


def _saved(root: Any) -> Any:
    async def load() -> Any:
        async with Checkpointer(str(root)) as ckpt:
            return await ckpt.load()

    return run_sync(load())


def _expected(engine: Any, opt: Any) -> dict[str, Any]:
    return {
        "opt": opt.state_dict()["state"],  # read from the swap file: the state now
        "master": [m.clone() for m in engine.zero.state_dict()["master"]],
    }


def _holds(saved: Any, expected: dict[str, Any]) -> bool:
    opt = saved["stepper"]["state"]
    same = all(
        torch.equal(opt[i]["exp_avg"].view(-1), e["exp_avg"].view(-1))
        and torch.equal(opt[i]["exp_avg_sq"].view(-1), e["exp_avg_sq"].view(-1))
        and torch.equal(opt[i]["step"], e["step"])
        for i, e in expected["opt"].items()
    )
    masters = saved["zero"]["master"]
    return same and all(torch.equal(a, b) for a, b in zip(masters, expected["master"], strict=True))


def _nvme(tmp_path: Any) -> tuple[Any, Any]:
    swap = tmp_path / "swap"
    swap.mkdir(exist_ok=True)
    engine, opt, _, _ = dstrain.initialize(
        model=make_model(dim=DIM), config=offload_config(1, "nvme", str(swap), sub_group=4096)
    )
    assert len(opt.sub_groups) >= 8
    return engine, opt


def _async_save_then_steps(tmp_path: Any, box: dict[str, Any], steps: int) -> dict[str, Any]:
    engine, opt = _nvme(tmp_path)
    try:
        engine_losses(engine, 2)
        expected = _expected(engine, opt)
        engine.save_checkpoint(tmp_path / "ck", async_save=True)
        capture = engine.checkpoints.pending._capture
        box["capture"] = capture
        engine_losses(engine, steps, start=2)  # rewrites every sub-group's m, v while the save streams
        # the steps are done; the save still needs swap reads, which are held from now on
        deadline = time.monotonic() + 30
        while box["held"] == 0 and not capture.over.done() and time.monotonic() < deadline:
            time.sleep(0.01)
        streaming = not capture.over.done()
        held = box["held"]
        versions = opt.statistics().swapper.versions
        box["release"]()
        engine.wait_checkpoint()
        after = opt.statistics().swapper.versions
    finally:
        engine.close()
    return {
        "expected": expected,
        "saved": _saved(tmp_path / "ck"),
        "streaming": streaming,
        "held": held,
        "versions": versions,
        "after": after,
    }


def test_steps_run_while_the_save_still_reads_the_pinned_state(tmp_path, held_reads) -> None:
    r = _async_save_then_steps(tmp_path, held_reads, steps=2)
    # two steps finished while the save's reads of the swapped state were still held back
    assert r["streaming"] and r["held"] > 0
    assert _holds(r["saved"], r["expected"])  # bitwise the state at the save
    v = r["versions"]
    assert v.pins == 1 and v.relocations >= 8  # the first step wrote every sub-group around the pin
    a = r["after"]
    assert a.pins == 0 and a.spare_bytes == v.pinned_bytes  # released: the old versions are spares
    assert a.grown_bytes == v.pinned_bytes  # the file grew once, by the pinned bytes


def test_without_copy_on_write_the_checkpoint_holds_post_step_bytes(
    tmp_path, monkeypatch, held_reads
) -> None:
    """The check above can fail: with writes of pinned slots made in place, the step overwrites
    the versions the save has not read yet, and the checkpoint is no longer the saved step."""
    in_place = SlotTable.for_write

    def no_relocation(self: SlotTable, key: Any) -> tuple[int, int]:
        pinned, self._pinned = self._pinned, {}
        try:
            return in_place(self, key)
        finally:
            self._pinned = pinned

    monkeypatch.setattr(SlotTable, "for_write", no_relocation)
    r = _async_save_then_steps(tmp_path, held_reads, steps=1)
    assert r["streaming"] and r["held"] > 0
    assert not _holds(r["saved"], r["expected"])


_ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize(
    ("device", "model_on"),
    [
        ("none", "cpu"),
        ("cpu", "cpu"),
        ("nvme", "cpu"),
        pytest.param("nvme", "cuda", id="nvme-cuda", marks=_ON_GPU),
        pytest.param("cpu", "cuda", id="cpu-cuda", marks=_ON_GPU),
    ],
)
def test_resuming_from_an_async_save_equals_resuming_from_a_sync_save(
    tmp_path, one_thread, device, model_on
) -> None:
    """Async save at step 2, three more steps; a fresh run loading it continues bitwise like one
    loading a synchronous save of step 2 (and like the run that saved it). On CUDA (``-m gpu``)
    the masters live on the device and the swapped state is staged through it."""
    swap = tmp_path / "swap"
    swap.mkdir()
    cfg = offload_config(1, device, str(swap), sub_group=4096)
    runs: dict[str, list[float]] = {}
    params: dict[str, list[torch.Tensor]] = {}
    for how in ("async", "sync"):
        engine, _, _, _ = dstrain.initialize(model=make_model(dim=DIM).to(model_on), config=cfg)
        engine_losses(engine, 2)
        engine.save_checkpoint(tmp_path / how, async_save=how == "async")
        if how == "async":
            runs["saver"] = engine_losses(engine, 3, start=2)
        engine.close()
    for how in ("async", "sync"):
        engine, _, _, _ = dstrain.initialize(model=make_model(seed=3, dim=DIM).to(model_on), config=cfg)
        engine.load_checkpoint(tmp_path / how)
        assert engine.global_steps == 2
        runs[how] = engine_losses(engine, 3, start=2)
        params[how] = [p.detach().clone() for p in engine.module.parameters()]
        engine.close()
    assert runs["async"] == runs["sync"] == runs["saver"]
    assert all(torch.equal(a, b) for a, b in zip(params["async"], params["sync"], strict=True))


def test_back_to_back_saves_and_a_save_while_one_streams(tmp_path, one_thread, monkeypatch) -> None:
    """Two async saves at the same step, then one a step later while the second may still stream:
    each checkpoint holds its own step bitwise; every pin is released and the spares are reused."""
    monkeypatch.setattr(_stream, "STREAM_CHUNK_BYTES", 16 << 10)
    read = SwapRegions.read_into

    async def slow(self: SwapRegions, io: Any, offset: int, out: torch.Tensor) -> None:
        await asyncio.sleep(0.005)
        await read(self, io, offset, out)

    monkeypatch.setattr(SwapRegions, "read_into", slow)
    engine, opt = _nvme(tmp_path)
    try:
        engine_losses(engine, 2)
        at2 = _expected(engine, opt)
        engine.save_checkpoint(tmp_path / "a", async_save=True)
        engine.save_checkpoint(tmp_path / "b", async_save=True)  # waits for a's commit, then pins
        engine_losses(engine, 1, start=2)
        at3 = _expected(engine, opt)
        engine.save_checkpoint(tmp_path / "c", async_save=True)
        engine_losses(engine, 2, start=3)
        engine.wait_checkpoint()
        v = opt.statistics().swapper.versions
        state_bytes = sum(opt.swapped.swapper.slot_bytes(sg.index) for sg in opt.sub_groups)
    finally:
        engine.close()
    assert _holds(_saved(tmp_path / "a"), at2) and _holds(_saved(tmp_path / "b"), at2)
    assert _holds(_saved(tmp_path / "c"), at3)
    assert v.pins == 0 and v.grown_bytes <= state_bytes  # one state's worth at most, reused since


def test_failed_saves_release_their_pins(tmp_path, one_thread, monkeypatch) -> None:
    """Saves whose swap reads fail, a failing synchronous save and a torch.save fallback save: none
    leaves a pin behind, the file does not grow past one state's worth over many saves, and the
    last good checkpoint holds its step."""
    from dstrain.checkpoint.store import TorchSaveStore

    read = SwapRegions.read_into
    fail = {"on": False}

    async def flaky(self: SwapRegions, io: Any, offset: int, out: torch.Tensor) -> None:
        if fail["on"]:
            raise OSError(5, "injected swap read failure")
        await read(self, io, offset, out)

    monkeypatch.setattr(SwapRegions, "read_into", flaky)
    engine, opt = _nvme(tmp_path)
    store, step = engine.store, 1
    try:
        engine_losses(engine, 1)
        state_bytes = sum(opt.swapped.swapper.slot_bytes(sg.index) for sg in opt.sub_groups)
        for k in range(6):
            fail["on"] = k % 2 == 0
            if k == 4:  # a synchronous save that fails raises at the call
                with pytest.raises(OSError):
                    engine.save_checkpoint(tmp_path / f"ck{k}")
            else:
                engine.save_checkpoint(tmp_path / f"ck{k}", async_save=True)
                engine_losses(engine, 1, start=step)
                step += 1
                if fail["on"]:
                    with pytest.raises(OSError):
                        engine.wait_checkpoint()
                else:
                    engine.wait_checkpoint()
            assert opt.statistics().swapper.versions.pins == 0, k
        fail["on"] = False
        good = _expected(engine, opt)
        engine.store = TorchSaveStore()
        saved = engine.save_checkpoint(tmp_path / "pt")
        engine.store = store
        v = opt.statistics().swapper.versions
    finally:
        engine.close()
    assert v.pins == 0 and v.grown_bytes <= state_bytes
    assert _holds(torch.load(saved, weights_only=True), good)


def test_the_windows_the_step_waits_for_hold_almost_no_swapped_bytes(tmp_path, one_thread) -> None:
    """In an NVMe run's streamed checkpoint, a window holding bytes training can change (the step
    waits for it) holds pinned swap bytes only where the optimizer's section meets an in-memory one:
    Adam's step counts, written between the pinned m and v of each tensor, are stable copies."""
    from dsio.checkpoint._capture import is_stable, plan_windows
    from dsio.checkpoint._format import layout
    from dsio.checkpoint._state import flatten
    from dstrain.checkpoint.gate import touch_order
    from dstrain.checkpoint.sources import release_sources
    from dstrain.checkpoint.state import collect

    engine, opt = _nvme(tmp_path)
    try:
        engine_losses(engine, 1)
        state = collect(engine.checkpoint_parts(), {})
        try:
            tensors, _ = flatten(state, allow_pickle=False)
        finally:
            release_sources(state)
        order = touch_order(engine.stepper, engine.module)
    finally:
        engine.close()
    steps = [n for n in tensors if n.endswith("/step")]
    assert len(steps) >= 3 and all(is_stable(tensors[n]) for n in steps)
    entries = layout((n, t.dtype, tuple(t.shape)) for n, t in tensors.items())
    chunk = 16 << 10
    plan = plan_windows(entries, tensors, chunk, entries[-1].end, order)
    stable = [e for e in entries if is_stable(tensors[e.name])]
    mixed = [
        w
        for w in range(len(plan.volatile))
        if plan.volatile[w] and any(e.begin < (w + 1) * chunk and w * chunk < e.end for e in stable)
    ]
    assert len(mixed) <= 2, mixed
