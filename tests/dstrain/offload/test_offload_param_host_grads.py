"""Parameters and optimizer state on NVMe on a GPU (`dstrain.offload.param.shards.OffloadedShards` with
`holds_master`): the fp32 gradient partitions live in host memory, page-locked, as ZeRO-Offload's do
(`dstrain.offload.param.host_master.HostGradCopies`: each unit's first gradient of a window put
straight into its range, later ones staged), and the step runs on the host beside the master range
read from the file. On a CPU run nothing changes (the gradients are host tensors anyway; the CPU
parity of this mode: tests/dstrain/offload/test_offload_param.py, test_offload_grads.py,
test_offload_step_thread.py).

Under ``-m gpu``: the placement, a GPU peak lower by the 4 bytes a parameter of the partitions than
the same run with them on the GPU (``grads_on_host=False``, the layout before), and the same training
within the rounding of CPU vs CUDA Adam, fp32 and bf16, one and two micro-steps a window (the
staged add of a later micro-step)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _dstrain_helpers import make_model
from _offload_helpers import param_config, train_drained

pytest.importorskip("dsio._C", reason="dsio's native core is not built here")

import dstrain.offload.param.shards as shards_mod  # noqa: E402

STEPS = 4
DIM = 256  # ~0.55M parameters: the partitions' 2.2 MB stand well above the allocator's rounding


def _train(cfg: dict[str, Any], device: str) -> dict[str, Any]:
    def measure(engine: Any) -> dict[str, Any]:
        groups = engine.zero.groups
        return {
            "store": type(engine.zero.store).__name__,
            "grads_pinned": all(g.master_grad.is_pinned() for g in groups),
            "master_bytes": sum(g.master.untyped_storage().nbytes() for g in groups),
            "grad_numel": sum(g.master_grad.numel() for g in groups),
        }

    return train_drained(cfg, make_model(dim=DIM).to(device), STEPS, measure)


def _config(root: str, bf16: bool, gas: int) -> dict[str, Any]:
    cfg = param_config(root, param="nvme", optimizer="nvme", bf16=bf16, budget=64 << 20, sub_group=16384)
    cfg["zero_optimization"]["offload_param"]["pin_memory"] = True
    cfg["zero_optimization"]["offload_optimizer"]["pin_memory"] = True
    if gas > 1:
        cfg["gradient_accumulation_steps"] = gas
        cfg["train_batch_size"] = cfg["train_micro_batch_size_per_gpu"] * gas
    return cfg


def test_on_a_cpu_run_the_gradients_stay_host_tensors_of_the_group(tmp_path) -> None:
    """A CPU run of the mode: the store is `OffloadedShards`, the partitions plain host tensors (not
    page-locked: nothing crosses a bus), the master in the file, and it trains."""
    got = _train(_config(str(tmp_path), bf16=True, gas=1), "cpu")
    assert got["store"] == "OffloadedShards" and got["grad_devices"] == {"cpu"}
    assert not got["grads_pinned"] and got["master_bytes"] == 0
    assert got["losses"][-1] < got["losses"][0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("bf16", "gas"), [(False, 1), (True, 1), (True, 2)])
def test_on_cuda_the_gradient_partitions_live_in_pinned_host_memory(monkeypatch, tmp_path, bf16, gas) -> None:
    cfg = _config(str(tmp_path), bf16, gas)
    got = _train(cfg, "cuda")
    assert got["store"] == "OffloadedShards"
    assert got["grad_devices"] == {"cpu"} and got["grads_pinned"]
    assert got["master_bytes"] == 0  # the master stays in its file
    assert got["early"] > 0  # sub-groups still step during backward (now on the host)

    class GradsOnGpu(shards_mod.OffloadedShards):  # the layout before: partitions in the GPU's memory
        def __init__(self, *a: Any, **k: Any) -> None:
            super().__init__(*a, grads_on_host=False, **k)

    monkeypatch.setattr(shards_mod, "OffloadedShards", GradsOnGpu)
    ref = _train(cfg, "cuda")
    monkeypatch.undo()
    assert ref["grad_devices"] == {"cuda"}
    # the fp32 partitions (4 bytes an element) are off the GPU, and the step's scratch slots with them;
    # what the copies out add is one fp32 piece in flight: at most the largest parameter upcast
    largest = max(p.numel() for p in make_model(dim=DIM).parameters())
    saved = 4 * (got["grad_numel"] - largest)
    assert got["gpu_peak"] <= ref["gpu_peak"] - saved, (got["gpu_peak"], ref["gpu_peak"], saved)
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-2 if bf16 else 1e-4)
    for a, b in zip(got["params"], ref["params"], strict=True):
        assert torch.allclose(a.float(), b.float(), rtol=1e-2 if bf16 else 1e-4, atol=1e-3 if bf16 else 1e-5)
