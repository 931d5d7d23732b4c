"""Parameters on NVMe: ``stage3_max_live_parameters`` caps the gathered copies the gather prefetch holds.

With the shards in a file (``offload_param``) every gather copies its unit's shard into a full buffer
of the unit's own on the training device; at world size 1 with resident shards a pass binds the
parameters to the shards and gathers no copy (tests/dstrain/zero/test_zero3_memory.py), so this is the
mode where prefetching costs device memory: up to ``stage3_max_live_parameters`` elements (DeepSpeed's
default 1e9) of gathered copies, 1.85 GiB at the 1.07B GPT's GPU peak on the H200
(bench/results/offload-gpu-h200-2026-12-01-s9-call2.md). Prefetching (`GatherScheduler._prefetch`)
starts no gather that would take the gathered elements past the cap (as DeepSpeed's coordinator;
the units a running module needs are gathered whatever it says), and the order of the gathers changes
nothing the arithmetic sees: the same losses and parameters, bit for bit.

Measured from the buffers themselves: the gathered elements at each gather (a spy on the store's
`input_for`, which every gather calls once its buffer is allocated), beside the strategy's own
`ZeroStatistics.peak_resident_param_numel`. Under ``-m gpu``: the GPU peak is lower by the bytes the
cap keeps out."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
from _dstrain_helpers import TanhStack
from _offload_helpers import final_params

pytest.importorskip("dsio._C", reason="dsio's native core is not built here")

import dstrain  # noqa: E402

DEPTH, STEPS = 8, 3


def _config(root: str, cap: int | None, *, bf16: bool = False, sub_group: int = 4096) -> dict[str, Any]:
    zero: dict[str, Any] = {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "sub_group_size": sub_group,
        "offload_param": {
            "device": "nvme",
            "nvme_path": root,
            "buffer_count": 3,
            "buffer_size": 1 << 20,
            "pin_memory": True,  # on a GPU: the gradient partitions in page-locked host memory, as the bench
        },
        "offload_optimizer": {"device": "nvme", "nvme_path": root},
    }
    if cap is not None:
        zero["stage3_max_live_parameters"] = cap
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": zero,
    }
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def _train(
    root: str, cap: int | None, width: int, device: str = "cpu", bf16: bool = False, depth: int = DEPTH
) -> dict[str, Any]:
    """``STEPS`` steps of a `TanhStack` (``depth`` equal units) with parameters and optimizer state on
    NVMe; the gathered elements' peak measured at every gather, losses, final parameters, and on CUDA
    the GPU peak over the steps beyond what was allocated before the engine was built."""
    base = 0
    if device == "cuda":  # (what earlier tests left is collected first: see test_offload_param_host_grads)
        gc.collect()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
    torch.manual_seed(0)
    engine, _, _, _ = dstrain.initialize(
        # (a sub-group of about a unit: the optimizer's steps stay few on the wide model)
        model=TanhStack(width, depth).to(device),
        config=_config(root, cap, bf16=bf16, sub_group=max(4096, width * width)),
    )
    try:
        store, units = engine.zero.store, engine.zero.units
        assert store.holds_master and all(not u.persistent for u in units)
        inner = store.input_for
        peak = 0

        def measuring(unit: Any) -> torch.Tensor:
            nonlocal peak  # the gathered full buffers' elements, this unit's just allocated among them
            peak = max(peak, sum(u.full.untyped_storage().nbytes() // u.full.element_size() for u in units))
            return inner(unit)

        store.input_for = measuring  # every gather calls its unit's store for the shard
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        g = torch.Generator().manual_seed(0)
        losses = []
        for _ in range(STEPS):
            x, y = (torch.randn(4, width, generator=g).to(device) for _ in range(2))
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out = {
            "unit": units[0].numel,
            "peak": peak,
            "stats": engine.statistics().zero,
            "losses": losses,
            "gpu_peak": torch.cuda.max_memory_allocated() - base if device == "cuda" else 0,
        }
        out["params"] = final_params(engine)
        return out
    finally:
        engine.close()


@pytest.mark.parametrize("units", [2, 3])
def test_prefetch_keeps_the_gathered_elements_within_max_live_parameters(tmp_path, units: int) -> None:
    free = _train(str(tmp_path / "free"), None, 64)
    unit = free["unit"]
    cap = units * unit
    capped = _train(str(tmp_path / "cap"), cap, 64)
    # without the cap (DeepSpeed's 1e9) the prefetch gathers the whole model ahead
    assert free["peak"] == DEPTH * unit
    assert free["stats"].peak_resident_param_numel == free["peak"]
    # with it: never past the cap, and prefetching still fills it (the overlap is kept)
    assert capped["peak"] == cap
    assert capped["stats"].peak_resident_param_numel == cap
    assert capped["stats"].prefetches > 0
    # the order of the gathers changes no arithmetic
    assert capped["losses"] == free["losses"]
    assert all(torch.equal(a, b) for a, b in zip(capped["params"], free["params"], strict=True))


def test_a_cap_below_one_unit_prefetches_nothing_and_still_trains_the_same(tmp_path) -> None:
    """A cap smaller than any unit stops every prefetch (a running module's own units are gathered
    regardless): one unit gathered at a time, the same training bit for bit, bf16 too."""
    free = _train(str(tmp_path / "free"), None, 64, bf16=True)
    one = _train(str(tmp_path / "one"), 1, 64, bf16=True)
    assert one["stats"].prefetches == 0 and one["peak"] == one["unit"]
    assert free["stats"].prefetches > 0
    assert one["losses"] == free["losses"]
    assert all(torch.equal(a, b) for a, b in zip(one["params"], free["params"], strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_cap_lowers_the_gpu_peak_by_the_copies_it_keeps_out(tmp_path) -> None:
    """The H200 bench's mode in miniature (bf16, parameters and optimizer state on NVMe, world 1, the
    gradient partitions in page-locked host memory): with a cap of two units the GPU peak is lower
    than without by at least half the gathered copies' bytes the cap keeps out (14 of 16 units; the
    other half allows for backward's own bytes where the capped run peaks: a unit's bf16 gradient and
    its fp32 piece on the way to the host, 6 bytes an element, beside the two gathered units), and
    the training is bitwise the same (the same kernels in the same order; only the gathers move)."""
    width, depth = 1024, 16  # units of ~1M elements: 2 MiB each at bf16, far above the allocator's rounding
    free = _train(str(tmp_path / "free"), None, width, "cuda", bf16=True, depth=depth)
    cap = 2 * free["unit"]
    capped = _train(str(tmp_path / "cap"), cap, width, "cuda", bf16=True, depth=depth)
    assert free["peak"] == depth * free["unit"] and capped["peak"] == cap
    kept_out = (free["peak"] - capped["peak"]) * 2  # bf16 bytes
    lower = free["gpu_peak"] - capped["gpu_peak"]
    assert lower >= 0.5 * kept_out, (free["gpu_peak"], capped["gpu_peak"], kept_out)
    assert capped["losses"] == free["losses"]
    assert all(torch.equal(a, b) for a, b in zip(capped["params"], free["params"], strict=True))
