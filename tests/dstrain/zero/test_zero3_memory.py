"""Stage 3 keeps about 1/world of the parameters per rank (measured from the storages themselves)."""

from __future__ import annotations

from typing import Any

import pytest
from _dstrain_helpers import memory_run, spawn

from dstrain.zero.flat import ALIGN

DIM = 96  # ~80k parameters: padding to a multiple of world size is negligible


def _runs() -> dict[int, Any]:
    return {stage: memory_run(stage, DIM) for stage in (0, 3)}


@pytest.fixture(scope="module")
def world2() -> list[dict[int, Any]]:
    return spawn(_runs, world=2, start_method="forkserver")


@pytest.mark.parametrize("rank", [0, 1])
def test_stage3_resident_parameters_are_half_the_model(rank: int, world2: list[dict[int, Any]]) -> None:
    out = world2[rank][3]
    model = out["model"]
    for measured in (out["after_init"], out["after_train"]):
        assert 0.49 * model <= measured <= 0.51 * model
    # the strategy's own accounting agrees with the measurement
    assert out["stats"].resident_param_numel == out["after_train"]
    # while running, at most the shards plus the gathered modules are resident: less than shards + model
    assert out["after_train"] < out["stats"].peak_resident_param_numel < 1.5 * model + 64


@pytest.mark.parametrize("rank", [0, 1])
def test_stage0_keeps_the_whole_model(rank: int, world2: list[dict[int, Any]]) -> None:
    out = world2[rank][0]
    # the flat buffer is padded to whole ALIGN-element blocks per rank (dstrain.zero.flat.ALIGN)
    assert out["model"] <= out["after_train"] < out["model"] + 2 * ALIGN


def test_stage3_world1_keeps_everything() -> None:
    out = memory_run(3, 16)
    assert out["after_train"] == pytest.approx(out["model"], abs=1)


def test_full_state_dict_gathers_stage3_weights() -> None:
    from _dstrain_helpers import base_config, engine_losses, make_model

    import dstrain

    states = {}
    for stage in (0, 3):
        engine, _, _, _ = dstrain.initialize(model=make_model(), config=base_config(stage, world=1))
        engine_losses(engine, 3)
        states[stage] = engine.full_state_dict()
        if stage == 3:  # released again afterwards
            assert engine.statistics().zero.resident_param_numel == engine.statistics().zero.master_numel
        engine.close()
    assert states[3].keys() == states[0].keys()
    for key in states[0]:
        assert states[3][key].shape == states[0][key].shape
        assert states[3][key].allclose(states[0][key], rtol=1e-5, atol=1e-6)


def _prefetches_per_two_steps(eval_first: bool) -> int:
    import torch
    from _dstrain_helpers import base_config, engine_losses, global_batch, make_model

    import dstrain

    cfg = base_config(3, world=1)
    engine, _, _, _ = dstrain.initialize(model=make_model(), config=cfg)
    if eval_first:  # a forward-only pass is recorded first: training must re-record, not stop prefetching
        with torch.no_grad():
            engine(*global_batch(0, 4))
    engine_losses(engine, 3)
    before = engine.statistics().zero.prefetches
    engine_losses(engine, 2, start=3)
    engine.close()
    return engine.statistics().zero.prefetches - before


def test_stage3_prefetch_follows_the_recorded_order_and_adapts() -> None:
    plain = _prefetches_per_two_steps(eval_first=False)
    assert plain > 0
    assert _prefetches_per_two_steps(eval_first=True) == plain


def test_stage3_world1_gathers_no_copies_of_the_shards() -> None:
    """At world size 1 a shard is its whole unit: a pass's gathers (prefetched ones too) bind the
    parameters to the shard itself (`Unit.bind_shard`), as DeepSpeed's world-1 gather does, so the
    resident parameter elements never exceed the shards (with copies, prefetching up to
    ``stage3_max_live_parameters`` held a second copy of most of the model at its peak)."""
    out = memory_run(3, 16)
    stats = out["stats"]
    assert stats.prefetches > 0  # the passes prefetched (bound ahead), as at any world size
    assert stats.peak_resident_param_numel == stats.resident_param_numel == out["after_train"]


def test_stage3_world1_persistent_units_view_their_shards_and_train_the_same() -> None:
    """Persistent units (gathered from the start) move onto their shards too, train bitwise like
    released ones, and a `GatheredParameters` block that raises still discards its change (the block
    works on a copy of its own, not on the shard)."""
    import torch
    from _dstrain_helpers import base_config, engine_losses, make_model

    import dstrain
    from dstrain.zero import GatheredParameters

    runs = {}
    for threshold in (0, 10**9):  # none persistent / all persistent
        cfg = base_config(3, world=1)
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = threshold
        engine = dstrain.initialize(model=make_model(), config=cfg)[0]
        losses = engine_losses(engine, 3)
        stats = engine.statistics().zero
        assert stats.peak_resident_param_numel == stats.resident_param_numel == stats.master_numel
        w = next(engine.module.parameters())
        try:
            with GatheredParameters(w, modifier_rank=0), torch.no_grad():
                before = w.detach().clone()
                w.add_(1.0)
                raise ValueError("inside the block")
        except ValueError:
            pass
        with GatheredParameters(w):
            assert torch.equal(w, before)  # discarded
        runs[threshold] = losses + engine_losses(engine, 1, start=3)
        engine.close()
    assert runs[0] == runs[10**9]


@pytest.mark.parametrize("persistent", [False, True])
def test_stage3_world1_what_a_caller_takes_between_steps_is_a_copy(persistent: bool) -> None:
    """Between steps (`gathered_module`, `gathered_units`, `GatheredParameters`) a unit gathers into
    a buffer of its own even at world size 1, where a pass binds its parameters to the shard: a tensor
    taken then keeps the values of then after the next step changes the shards. A persistent unit
    stays on that copy until the next step or block moves it back onto its shard (`Unit.regather`):
    the copy is let go then, never gathered into again (the block after the step would overwrite
    what was taken)."""
    import torch
    from _dstrain_helpers import base_config, engine_losses, make_model

    import dstrain
    from dstrain.zero import GatheredParameters

    cfg = base_config(3, world=1)
    if persistent:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 10**9  # every unit
    engine = dstrain.initialize(model=make_model(), config=cfg)[0]
    try:
        engine_losses(engine, 1)
        engine.zero.gathered_module()
        taken = [p.data for p in engine.module.parameters()]  # views, no copies
        values = [t.clone() for t in taken]
        engine.zero.release_all()
        per_unit = [(ps[0].data, ps[0].detach().clone()) for ps in engine.zero.gathered_units()]
        w = next(engine.module.parameters())
        with GatheredParameters(w):
            block_view = w.data
            block_values = block_view.clone()
        engine_losses(engine, 1, start=1)  # the step changes every shard
        with GatheredParameters(w):
            assert not torch.equal(w, block_values)  # (it trained)
        for t, v in zip(taken, values, strict=True):
            assert torch.equal(t, v)
        for t, v in per_unit:
            assert torch.equal(t, v)
        assert torch.equal(block_view, block_values)
    finally:
        engine.close()


def _dropped_engine_parts_alive(stage: int, close: bool) -> list[bool]:
    """Train an engine, drop it (closed or not), collect: which of its parts are still alive."""
    import gc
    import weakref

    from _dstrain_helpers import base_config, engine_losses, make_model

    import dstrain

    def trained() -> list[weakref.ref[Any]]:
        engine = dstrain.initialize(model=make_model(), config=base_config(stage, world=1))[0]
        engine_losses(engine, 2)
        parts: list[Any] = [engine, engine.zero, engine.module, engine.stepper]
        if stage == 3:
            parts += [engine.zero.store, engine.zero.units[0], engine.zero.groups[0].shards]
        if close:
            engine.close()
        return [weakref.ref(x) for x in parts]

    dropped = trained()
    gc.collect()
    return [ref() is not None for ref in dropped]


@pytest.mark.parametrize("close", [False, True])
@pytest.mark.parametrize("stage", [1, 3])
def test_an_engine_dropped_is_collected_with_its_zero_strategy(stage: int, close: bool) -> None:
    """A training script that drops an engine, closed or not (a search loop building one a trial), gets
    its memory back at garbage collection: the strategy, its units, store and shards, the model and the
    optimizer go. Stage 3's post-accumulate-grad hooks live in the parameters' hook dicts, which torch's
    collector does not traverse: a hook holding the strategy strongly kept all of it alive for good;
    and `unit_of`'s map (parameter -> unit, weak keys) held each unit strongly, which holds its
    parameters: no entry ever went, closed engines' shards included.

    In a process of its own, as a script is: in a long-lived xdist worker of the whole suite (root
    fresh-clone run, 2026-12-02 01:30) the dropped stage-3 model was once still referenced after a
    collection by something an earlier test of that worker left (not reproduced in one process over
    tests/dstrain/{zero,checkpoint,checkpointing,integrations} and the offload step-thread / metrics
    files)."""
    from _dstrain_helpers import spawn

    alive = spawn(_dropped_engine_parts_alive, stage, close, world=1, start_method="forkserver")[0]
    assert alive == [False] * len(alive)
