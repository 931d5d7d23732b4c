"""The engine members HF Trainer, Accelerate and DeepSpeed's tests call, with DeepSpeed's semantics."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from _dstrain_helpers import Tiny, base_config, global_batch, make_model

import dstrain
from dstrain.errors import DstrainError, PartitionedSaveError


def _engine(stage: int = 0, **extra: Any) -> Any:
    engine, _, _, _ = dstrain.initialize(model=make_model(), config=base_config(stage, world=1, **extra))
    return engine


def _micro(engine: Any, step: int, micro: int = 0) -> torch.Tensor:
    idx, targets = global_batch(step, 8)
    lo = micro * 4
    return engine(idx[lo : lo + 4], targets[lo : lo + 4])


def test_backward_returns_loss_over_accumulation_steps() -> None:
    engine = _engine(gas=2)
    loss = _micro(engine, 0)
    returned = engine.backward(loss)
    assert torch.equal(returned, loss / 2)  # DeepSpeed: 4.59375 -> 2.296875 with 2 accumulation steps
    engine.close()


@pytest.mark.parametrize("gas", [2, 3])
def test_last_loss_is_the_mean_micro_loss_with_and_without_scale_wrt_gas(gas: int) -> None:
    """``statistics().last_loss`` is the mean of the step's micro-losses whether the engine divides
    them (``scale_wrt_gas=True``) or the caller did (``False``, as HF's Trainer does): the divided
    losses are not divided again."""
    raw: list[torch.Tensor] = []
    for scale_wrt_gas in (True, False):
        engine = _engine(gas=gas)
        for micro in range(gas):
            idx, targets = global_batch(0, 4 * gas)
            loss = engine(idx[4 * micro : 4 * micro + 4], targets[4 * micro : 4 * micro + 4])
            if scale_wrt_gas:
                raw.append(loss.detach())
                engine.backward(loss)
            else:
                engine.backward(loss / gas, scale_wrt_gas=False)
            engine.step()
        assert engine.global_steps == 1
        mean = sum(float(x) for x in raw) / gas
        # float32 sums of `gas` terms in either order: a few ulps of the mean apart
        assert engine.statistics().last_loss == pytest.approx(mean, rel=1e-6), scale_wrt_gas
        engine.close()


def test_set_gradient_accumulation_boundary_drives_the_step() -> None:
    ref = _engine(gas=2)
    for micro in range(2):
        ref.backward(_micro(ref, 0, micro))
        ref.step()
    manual = _engine(gas=2)
    for micro, boundary in ((0, False), (1, True)):
        manual.set_gradient_accumulation_boundary(boundary)
        assert manual.is_gradient_accumulation_boundary() is boundary
        manual.backward(_micro(manual, 0, micro))
        manual.step()
        assert manual.was_step_applied() is boundary
    for k, v in ref.full_state_dict().items():
        assert torch.equal(v, manual.full_state_dict()[k]), k
    manual.set_gradient_accumulation_boundary(True)  # every micro-step a boundary now
    manual.backward(_micro(manual, 1))
    manual.step()
    assert manual.was_step_applied() and manual.global_steps == 2
    with pytest.raises(TypeError):
        manual.set_gradient_accumulation_boundary(1)  # type: ignore[arg-type]
    ref.close()
    manual.close()


def test_was_step_applied_and_optimizer_overflow_under_fp16() -> None:
    engine = _engine(fp16={"enabled": True, "initial_scale_power": 4})
    assert engine.was_step_applied() is False  # DeepSpeed: False before any step
    engine.backward(_micro(engine, 0))
    engine.step()
    assert engine.was_step_applied() is True and engine.optimizer.overflow is False
    engine.backward(_micro(engine, 1) * float("inf"))
    engine.step()
    assert engine.was_step_applied() is False and engine.optimizer.overflow is True
    engine.close()


def test_get_global_grad_norm() -> None:
    engine = _engine()
    engine.backward(_micro(engine, 0))
    engine.step()
    assert engine.get_global_grad_norm() is None  # not computed: no clipping, no fp16
    engine.close()
    model = make_model()
    model(*[t[:4] for t in global_batch(0, 8)]).backward()
    expected = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).item()
    engine = _engine(gradient_clipping=1e9)
    assert engine.gradient_clipping() == 1e9
    engine.backward(_micro(engine, 0))
    engine.step()
    assert engine.get_global_grad_norm() == pytest.approx(expected, rel=1e-5)
    engine.close()


def test_no_sync_accumulates_without_stepping() -> None:
    ref = _engine()  # one micro-step over both halves' summed losses
    ref.backward(_micro(ref, 0, 0) + _micro(ref, 0, 1))
    ref.step()
    engine = _engine()
    with engine.no_sync():  # DeepSpeed: no reduction, no step, accumulation not counted
        assert not engine.is_gradient_accumulation_boundary()
        engine.backward(_micro(engine, 0, 0))
        with pytest.raises(DstrainError):
            engine.step()  # illegal inside no_sync
        with pytest.raises(DstrainError), engine.no_sync():  # no re-entry
            pass
    assert engine.global_steps == 0 and engine.micro_steps == 0
    engine.backward(_micro(engine, 0, 1))  # gradients of both halves accumulated, then the step
    engine.step()
    assert engine.was_step_applied() and engine.global_steps == 1
    for k, v in ref.full_state_dict().items():
        torch.testing.assert_close(engine.full_state_dict()[k], v, rtol=1e-5, atol=1e-6)
    ref.close()
    engine.close()
    stage2 = _engine(2)
    with pytest.raises(DstrainError, match="stage 2"), stage2.no_sync():
        pass
    stage2.close()


def test_config_reads_as_a_dict() -> None:
    engine = _engine(3)
    assert isinstance(engine.config, Mapping)
    assert engine.config["train_micro_batch_size_per_gpu"] == 4
    assert engine.config.get("zero_optimization")["stage"] == 3
    assert "fp16" in engine.config and dict(engine.config)["gradient_accumulation_steps"] == 1
    assert engine.config.train_batch_size == 4  # and still the parsed dataclass
    engine.close()


def test_small_accessors() -> None:
    engine = _engine(3)
    assert engine.device == torch.device("cpu")
    assert list(engine.parameters()) == list(engine.module.parameters())
    assert dict(engine.named_parameters()).keys() == dict(engine.module.named_parameters()).keys()
    assert engine.is_first_stage() and engine.is_last_stage()
    engine.zero.gathered_module()
    gathered = engine.statistics().zero.resident_param_numel
    engine.empty_partition_cache()
    assert engine.statistics().zero.resident_param_numel < gathered
    engine.destroy()
    assert not engine.module._forward_pre_hooks  # closed: stage 3's gather hooks are gone


class _PretrainedLike(Tiny):
    """A model with transformers' save_pretrained (a state dict into a directory)."""

    def save_pretrained(self, directory: str) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        torch.save(self.state_dict(), Path(directory) / "weights.pt")


def test_save_pretrained_under_zero3_raises_a_typed_error(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _PretrainedLike()
    engine, _, _, _ = dstrain.initialize(model=model, config=base_config(3, world=1))
    with pytest.raises(PartitionedSaveError, match="save_16bit_model|dstrain export"):
        engine.module.save_pretrained(str(tmp_path / "a"))
    engine.zero.gathered_module()  # gathered (as inside GatheredParameters): it saves as usual
    engine.module.save_pretrained(str(tmp_path / "b"))
    engine.empty_partition_cache()
    saved = torch.load(tmp_path / "b" / "weights.pt")
    assert all(torch.equal(saved[k], v) for k, v in engine.full_state_dict().items())
    engine.close()
    model2 = _PretrainedLike()
    engine2, _, _, _ = dstrain.initialize(model=model2, config=base_config(2, world=1))
    engine2.module.save_pretrained(str(tmp_path / "c"))  # below stage 3 nothing is partitioned
    engine2.close()
