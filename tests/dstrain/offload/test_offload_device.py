"""Offloaded Adam with the masters on the training device: one code path parameterised by device.

The body (`_check`) runs here on CPU and, marked ``gpu``, on CUDA (world 1, and 2 NCCL ranks where
two GPUs exist): optimizer state on host memory or NVMe, with and without parameter shards on NVMe,
fp32 and bf16, stages 2 and 3; losses and parameters after 5 steps bitwise equal to no offload on
the same device. On CUDA the state must really have travelled host <-> device (copied bytes > 0);
on CPU nothing is copied.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _dstrain_helpers import spawn
from _offload_helpers import device_parity_run

# ZeRO-Offload / -Infinity (issue 32): at stage 3 with the optimizer offloaded (CPU or NVMe) and the
# parameters resident, the fp32 master and gradients live in host memory and Adam steps there, as
# DeepSpeed does (`dstrain.offload.compose.build_param_store`: HostMasterShards for both devices).
HOST_MASTER = {"s3_opt_cpu", "s3_opt_nvme"}


def _check(results: dict[str, Any], device: str) -> None:
    for name, r in results.items():
        stage = name.split("_")[0]
        ref = results[f"{stage}_none"]
        host_master = device == "cuda" and name in HOST_MASTER
        assert r["master_device"].split(":")[0] == ("cpu" if host_master else device), name
        if r is ref or not r["offloaded"]:
            continue
        assert len(r["params"]) == len(ref["params"])
        if host_master:
            # the step runs in the CPU's fused Adam, the reference in the GPU's: the same update up to
            # the kernels' rounding (sqrt / division order), so equal within fp32 rounding over 5 steps,
            # not bitwise; bf16 parameters may round one ulp (2**-7 relative) the other way
            torch.testing.assert_close(r["losses"], ref["losses"], rtol=1e-5, atol=0)
            for a, b in zip(r["params"], ref["params"], strict=True):
                rtol = 2**-7 if a.dtype == torch.bfloat16 else 1e-4
                torch.testing.assert_close(a, b, rtol=rtol, atol=1e-6)
            assert not r["copied"], name  # Adam's state is stepped where it lives, beside the host master
            continue
        assert r["losses"] == ref["losses"], name
        for a, b in zip(r["params"], ref["params"], strict=True):
            assert torch.equal(a, b), name
        if device == "cpu":
            assert r["copied"] == 0, name  # masters, grads and state share the CPU: no copy at all
        else:
            assert r["copied"] > 0, name  # the state was stepped on the GPU, not on the host
    offloaded = [n for n, r in results.items() if r["offloaded"]]
    assert len(offloaded) == 6, offloaded  # s2 cpu/nvme, s3 cpu/nvme, s3 param+opt cpu/nvme


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_offload_on_cpu_masters_matches_no_offload(tmp_path, bf16: bool) -> None:
    _check(device_parity_run(str(tmp_path), "cpu", bf16), "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_offload_on_cuda_masters_matches_no_offload(tmp_path, bf16: bool) -> None:
    _check(device_parity_run(str(tmp_path), "cuda", bf16), "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices for an NCCL group")
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_offload_on_cuda_masters_two_nccl_ranks(tmp_path, bf16: bool) -> None:
    ranks = spawn(device_parity_run, str(tmp_path), "cuda", bf16, world=2, backend="nccl")
    for r in ranks:
        _check(r, "cuda")
    for name in ranks[0]:
        assert ranks[0][name]["losses"] == ranks[1][name]["losses"], name
