"""A sub-group step of `OffloadAdam` that raises where it runs inline (``step_thread: false``: during the
boundary backward, or in ``step()``) leaves the optimizer step incomplete. That sub-group is marked
stepped before it runs (a late reduction of it is an error either way), so a later ``engine.step()``
that went on would finish the step without it: each raises `IncompleteStepError` instead (its cause
the original error). So does a failure before a sub-group is marked stepped (its state's read): the
step is counted and others may be stepped, and the read-ahead no longer holds it. The step thread's
twin is in test_offload_step_thread.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _dstrain_helpers import engine_losses, global_batch, make_model
from _offload_helpers import offload_config

pytest.importorskip("dsio._C", reason="dsio's native core is not built here")

import dstrain  # noqa: E402
from dstrain.errors import IncompleteStepError  # noqa: E402


class _Injected(RuntimeError):
    pass


def _fail_call(monkeypatch: Any, n: int) -> dict[str, int]:
    """Make the ``n``-th call of the fused AdamW kernel from now raise `_Injected`."""
    real = torch._fused_adamw_
    seen = {"calls": 0}

    def kernel(*args: Any, **kwargs: Any) -> Any:
        seen["calls"] += 1
        if seen["calls"] == n:
            raise _Injected("one sub-group step failed")
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_fused_adamw_", kernel)
    return seen


@pytest.mark.parametrize("optimizer", ["cpu", "nvme"])
@pytest.mark.parametrize("where", ["backward", "step"])
def test_a_failed_inline_sub_group_step_is_never_skipped(monkeypatch, tmp_path, where, optimizer) -> None:
    cfg = offload_config(3, optimizer, str(tmp_path), sub_group=1024)
    cfg["optimizer"]["type"] = "AdamW"
    section = cfg["zero_optimization"]["offload_optimizer"]
    section["step_thread"] = False
    section["step_in_backward"] = where == "backward"
    engine, opt = dstrain.initialize(model=make_model(), config=cfg)[:2]
    try:
        assert engine.config.gradient_accumulation_steps == 1
        # the first (armed) pass only records; the reads ahead done before backward: on NVMe a
        # sub-group steps during backward only if its state is in memory
        engine_losses(engine, 1, hook=lambda step, micro: opt.drain())
        assert opt.statistics().sub_groups >= 3
        before = opt.statistics().stepped_in_backward
        idx, targets = global_batch(1, engine.config.train_batch_size)
        opt.drain()
        seen = _fail_call(monkeypatch, 2)  # the second sub-group's step: one done, one failed, some left
        if where == "backward":
            with pytest.raises(_Injected):
                engine.backward(engine(idx, targets))
            assert opt.statistics().stepped_in_backward == before + 1
        else:
            engine.backward(engine(idx, targets))
            with pytest.raises(_Injected):
                engine.step()
        assert seen["calls"] == 2
        monkeypatch.undo()
        seen = _fail_call(monkeypatch, 0)  # the kernel works again (counted): still, the step is incomplete
        for _ in range(2):
            with pytest.raises(IncompleteStepError) as info:
                engine.step()
            assert isinstance(info.value.__cause__, _Injected)
        assert seen["calls"] == 0  # no sub-group stepped after the failure
    finally:
        monkeypatch.undo()
        engine.close()


def test_a_failed_steps_buffers_all_go_back_when_one_give_back_raises() -> None:
    """`_hand_back_unwritten` (a step that failed or never ran): the gradient, master and m, v buffers go
    back to their pools each on its own, so one give-back that raises (best effort) does not keep the
    others lent to nobody, which would make later reads of those pools wait."""
    from types import SimpleNamespace

    from dstrain.offload.optimizer.adam import OffloadAdam

    back: list[str] = []

    def raising(_: Any) -> None:
        back.append("grad")
        raise RuntimeError("grad pool closed")

    fake = SimpleNamespace(
        _grads=SimpleNamespace(discard=raising),
        swapped=SimpleNamespace(
            master=SimpleNamespace(discard_master=lambda b: back.append("master")),
            swapper=SimpleNamespace(discard=lambda lease: back.append("m, v")),
        ),
    )
    OffloadAdam._hand_back_unwritten(fake, object(), (object(),), (object(),))  # type: ignore[arg-type]
    assert back == ["grad", "master", "m, v"]


def _nvme_engine_after_one_step(tmp_path: Any) -> tuple[Any, Any]:
    """AdamW with m, v on NVMe, sub-groups stepped inline in ``step()`` only, after one step."""
    cfg = offload_config(3, "nvme", str(tmp_path), sub_group=256)
    cfg["optimizer"]["type"] = "AdamW"
    section = cfg["zero_optimization"]["offload_optimizer"]
    section["step_thread"] = False
    section["step_in_backward"] = False
    engine, opt = dstrain.initialize(model=make_model(), config=cfg)[:2]
    engine_losses(engine, 1)
    return engine, opt


def _fail_read(monkeypatch: Any, opt: Any, n: int) -> dict[str, int]:
    """Hand the optimizer's read-ahead back, and make the ``n``-th m, v read submitted from now on fail
    as the disk's EIO would (its future raises `IOFailedError`); counts the reads."""
    import concurrent.futures
    import errno

    from dsio.errors import IOFailedError

    swapper = opt.swapped.swapper
    real = swapper.fetch
    calls = {"n": 0}

    def fetch(key: Any) -> Any:
        calls["n"] += 1
        if calls["n"] != n:
            return real(key)
        failed: concurrent.futures.Future[Any] = concurrent.futures.Future()
        failed.set_exception(IOFailedError(errno.EIO, swapper.path, 0))
        return failed

    opt.swapped.cancel_ahead()  # the next step's reads, submitted again (through ``fetch``)
    monkeypatch.setattr(swapper, "fetch", fetch)
    return calls


def test_a_sub_group_whose_state_read_failed_makes_the_step_incomplete(monkeypatch, tmp_path) -> None:
    """A sub-group's step can fail before it is marked stepped (its m, v read failed: the disk's EIO).
    The step's counters are already counted and earlier sub-groups stepped, so a later ``engine.step()``
    refuses with `IncompleteStepError` (cause: the read's error) rather than re-running the step."""
    from dsio.errors import IOFailedError

    engine, opt = _nvme_engine_after_one_step(tmp_path)
    try:
        assert opt.statistics().sub_groups >= 3
        _fail_read(monkeypatch, opt, 3)  # the third sub-group's: two step, then one fails
        idx, targets = global_batch(1, engine.config.train_batch_size)
        engine.backward(engine(idx, targets))
        seen = _fail_call(monkeypatch, 0)  # counts the kernel's calls
        with pytest.raises(IOFailedError):
            engine.step()
        stepped = seen["calls"]
        assert 0 < stepped < opt.statistics().sub_groups  # some stepped, the failed one and some others not
        for _ in range(2):
            with pytest.raises(IncompleteStepError) as info:
                engine.step()
            assert isinstance(info.value.__cause__, IOFailedError)
        assert seen["calls"] == stepped  # nothing stepped after the failure
    finally:
        monkeypatch.undo()
        engine.close()


def test_a_failed_read_ahead_never_taken_is_dropped_with_the_others(monkeypatch, tmp_path) -> None:
    """A read ahead that failed and was never taken (the read-ahead is handed back first: a state_dict
    between backward and step, or close) does not raise there, and every other buffer read ahead goes
    back to its pool: the reads start afresh and the step completes."""
    engine, opt = _nvme_engine_after_one_step(tmp_path)
    try:
        calls = _fail_read(monkeypatch, opt, 1)
        idx, targets = global_batch(1, engine.config.train_batch_size)
        engine.backward(engine(idx, targets))  # reads the step's state ahead: the first read fails
        assert calls["n"] >= 2
        monkeypatch.undo()
        state = opt.state_dict()  # hands the read-ahead back first
        assert len(state["state"]) > 0
        assert opt.statistics().swapper.buffers_in_use == 0
        engine.step()  # its reads submitted afresh
        assert opt.statistics().steps == 2
    finally:
        monkeypatch.undo()
        engine.close()


def test_a_take_whose_state_read_failed_hands_its_master_and_gradient_buffers_back() -> None:
    """`StateReads.take` of a sub-group whose m, v read failed raises that error, and the master and
    gradient ranges read for the same sub-group go back to their pools (the parameter store's buffers
    also serve the gathers: one lent to nobody would leave forward one buffer short for good)."""
    import concurrent.futures
    import errno
    from types import SimpleNamespace

    from dsio.errors import IOFailedError
    from dstrain.offload.optimizer.state_reads import StateReads

    back: list[str] = []

    def done(value: Any = None, error: BaseException | None = None) -> concurrent.futures.Future[Any]:
        f: concurrent.futures.Future[Any] = concurrent.futures.Future()
        f.set_exception(error) if error is not None else f.set_result(value)
        return f

    reads = StateReads(
        SimpleNamespace(discard=lambda lease: back.append("m, v")),  # type: ignore[arg-type]
        SimpleNamespace(discard_master=lambda b: back.append(f"master {b}"), settle=lambda: None),
        SimpleNamespace(discard=lambda b: back.append(f"grad {b}"), took=lambda f: None),
    )
    sg = object()
    state = done(error=IOFailedError(errno.EIO, "swap", 0))
    reads.ahead.append([sg, state, done(("mb", None)), done(("gb", None))])
    with pytest.raises(IOFailedError):
        reads.take(sg)  # type: ignore[arg-type]
    assert sorted(back) == ["grad gb", "master mb"]


@pytest.mark.parametrize("read", [1, 3])
def test_the_state_of_an_incomplete_step_is_neither_saved_nor_replaced(monkeypatch, tmp_path, read) -> None:
    """After a failed optimizer step the state is neither the last step's nor the next's (its count is
    taken, some sub-groups may be stepped: ``read=1`` fails the first sub-group's read, none stepped;
    ``read=3`` the third): `state_dict`, `checkpoint_state` (a checkpoint save) and `load_state_dict`
    raise `IncompleteStepError` (cause: the failure) instead of saving a state whose step count is one
    ahead of its m, v, or loading into an optimizer whose step can never finish."""
    from dsio.errors import IOFailedError

    engine, opt = _nvme_engine_after_one_step(tmp_path)
    try:
        good = opt.state_dict()
        _fail_read(monkeypatch, opt, read)
        idx, targets = global_batch(1, engine.config.train_batch_size)
        engine.backward(engine(idx, targets))
        with pytest.raises(IOFailedError):
            engine.step()
        for call in (opt.state_dict, opt.checkpoint_state, lambda: opt.load_state_dict(good)):
            with pytest.raises(IncompleteStepError) as info:
                call()
            assert isinstance(info.value.__cause__, IOFailedError)
    finally:
        monkeypatch.undo()
        engine.close()
