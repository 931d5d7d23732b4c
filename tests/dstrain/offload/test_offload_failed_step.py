"""A sub-group step of `OffloadAdam` that raises where it runs inline (``step_thread: false``: during the
boundary backward, or in ``step()``) leaves the optimizer step incomplete. That sub-group is marked
stepped before it runs (a late reduction of it is an error either way), so a later ``engine.step()``
that went on would finish the step without it: each raises `IncompleteStepError` instead (its cause
the original error). The step thread's twin is in test_offload_step_thread.py."""

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
