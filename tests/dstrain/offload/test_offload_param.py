"""Parameter offload (stage 3, ZeRO-Infinity ``offload_param``) trains bit-for-bit like no offload.

Two real gloo ranks, fp32 and bf16, 10 steps: shards on CPU or in an NVMe file (through dsio), with
or without optimizer state on NVMe; with parameters *and* optimizer state on NVMe at fp32 the master
lives only in the shard file (no resident copy); at bf16 in a master file of its own. An async save
of that run streams each rank's master partition from its file and resumes bitwise.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _dstrain_helpers import scratch_dir, spawn
from _offload_helpers import param_config, param_parity_run

STEPS = 10
BUDGET = 24 << 20  # small: several parameter buffers, and the optimizer gets what is left


def _scenarios(root: str) -> dict[str, dict[str, Any]]:
    out = {
        "none": param_config(root),
        "param_cpu": param_config(root, param="cpu"),
        "param_nvme": param_config(root, param="nvme", budget=BUDGET),
        "both_nvme": param_config(root, param="nvme", optimizer="nvme", budget=BUDGET),
    }
    out["none_clip"] = param_config(root, clip=0.05)
    out["param_nvme_clip"] = param_config(root, param="nvme", clip=0.05, budget=BUDGET)
    out["both_nvme_clip"] = param_config(root, param="nvme", optimizer="nvme", clip=0.05, budget=BUDGET)
    out["none_bf16"] = param_config(root, bf16=True)
    out["param_cpu_bf16"] = param_config(root, param="cpu", bf16=True)
    out["both_nvme_bf16"] = param_config(root, param="nvme", optimizer="nvme", bf16=True, budget=BUDGET)
    return out


@pytest.fixture(scope="module")
def runs() -> Iterator[list[dict[str, Any]]]:
    with scratch_dir("offload-param-") as root:
        yield spawn(_build_and_run, root, world=2, start_method="forkserver")


def _build_and_run(root: str) -> dict[str, Any]:
    out = param_parity_run(_scenarios(root), STEPS)
    out["streamed_save"] = _async_save_and_resume(root)
    return out


def _async_save_and_resume(root: str) -> dict[str, Any]:
    """Both on NVMe: 2 steps, an async save (each rank streams its master partition from its shard
    file, and m, v from the optimizer's) while 2 more steps run; then a run without offload loads it
    and trains those 2 steps again."""
    from _dstrain_helpers import engine_losses, make_model

    import dstrain

    ckpt = os.path.join(root, "streamed-save")
    cfg = param_config(root, param="nvme", optimizer="nvme", budget=BUDGET)
    engine, _, _, _ = dstrain.initialize(model=make_model(), config=cfg)
    first = engine_losses(engine, 2)
    lazy = all(type(m).__name__ == "SwapRegions" for m in engine.zero.checkpoint_state()["master"])
    engine.save_checkpoint(ckpt, async_save=True)
    during = engine_losses(engine, 2, start=2)
    engine.wait_checkpoint()
    engine.close()
    engine, _, _, _ = dstrain.initialize(model=make_model(seed=7), config=param_config(root))
    engine.load_checkpoint(ckpt)
    resumed = engine_losses(engine, 2, start=2)
    engine.close()
    return {"first": first, "during": during, "resumed": resumed, "lazy": lazy}


def _same(got: dict[str, Any], base: dict[str, Any]) -> None:
    assert got["losses"] == base["losses"]  # exact float equality, every step
    assert len(got["params"]) == len(base["params"])
    for a, b in zip(got["params"], base["params"], strict=True):
        assert a.dtype == b.dtype
        assert torch.equal(a, b)


# optimizer-only offload (cpu, nvme) at stage 3 on the same model and config: test_offload_parity.py
@pytest.mark.parametrize("name", ["param_cpu", "param_nvme", "both_nvme"])
def test_fp32_bitwise_identical_to_no_offload(runs: list[dict[str, Any]], name: str) -> None:
    for rank in runs:
        _same(rank[name], rank["none"])
        assert rank["none"]["losses"][-1] < rank["none"]["losses"][0]  # it trained


@pytest.mark.parametrize("name", ["param_nvme", "both_nvme"])
def test_clipped_same_norm_and_bitwise(runs: list[dict[str, Any]], name: str) -> None:
    for rank in runs:
        base, got = rank["none_clip"], rank[f"{name}_clip"]
        _same(got, base)
        assert got["grad_norm"] == base["grad_norm"]
        assert base["grad_norm"] > 0.05  # clipping really happened


@pytest.mark.parametrize("name", ["param_cpu_bf16", "both_nvme_bf16"])
def test_bf16_bitwise_identical_to_no_offload(runs: list[dict[str, Any]], name: str) -> None:
    for rank in runs:
        _same(rank[name], rank["none_bf16"])
        assert all(p.dtype == torch.bfloat16 for p in rank[name]["params"])


def test_shards_really_in_a_file_and_swapped(runs: list[dict[str, Any]]) -> None:
    for rank in runs:
        got = rank["param_nvme"]
        st = got["param"]
        sw = st.swapper
        assert st.device == "nvme" and not st.holds_master
        assert got["file_existed"] and not got["dir_after_close"]
        assert got["shard_numel_resident"] == 0  # no shard left in the training tensors
        # the shards were written once at initialize and once after every step, never more
        assert sw.written_bytes == sw.file_bytes * (STEPS + 1)
        assert sw.writes == st.shard_writes
        # every gather read its shard (forward and backward), hit or miss
        assert st.prefetch_hits + st.prefetch_misses > 0
        assert st.prefetch_hits > 0  # the recorded order really ran reads ahead
        assert sw.read_bytes >= st.shard_bytes * 2 * STEPS
        assert sw.peak_buffers_in_use <= sw.buffers
        assert st.pinned_bytes <= st.pinned_budget <= BUDGET


def test_both_on_nvme_keeps_no_master_in_memory(runs: list[dict[str, Any]]) -> None:
    for rank in runs:
        got = rank["both_nvme"]
        st, opt = got["param"], got["optimizer"]
        assert st.holds_master
        assert st.grads is None  # the budget holds the gradient shards: they stay in memory
        assert got["master_numel_resident"] == 0 and got["shard_numel_resident"] == 0
        # the master was read with m and v per sub-group and written back once per step
        assert st.master_reads == st.master_writes == opt.sub_groups * STEPS
        sw = st.swapper
        assert sw.written_bytes == sw.file_bytes * (STEPS + 1)
        # one budget for both pools, never exceeded
        assert st.pinned_bytes + opt.pinned_bytes <= BUDGET
        assert opt.swapper.peak_buffers_in_use <= opt.swapper.buffers
        # bf16: the fp32 master in a file of its own, the bf16 shards in theirs: neither in memory
        bf = rank["both_nvme_bf16"]
        bst = bf["param"]
        assert bst.holds_master and bf["master_numel_resident"] == 0 and bf["shard_numel_resident"] == 0
        msw = bst.master_swapper
        assert msw is not None and msw.file_bytes >= bst.shard_bytes * 2  # fp32: twice the bf16 shards
        # read and written once per sub-group per step (after the initial write)
        assert bst.master_reads == bst.master_writes == bf["optimizer"].sub_groups * STEPS
        assert msw.written_bytes == msw.file_bytes * (STEPS + 1)
        # the bf16 shards rewritten once per step from the stepped master, no more
        assert bst.swapper.written_bytes == bst.swapper.file_bytes * (STEPS + 1)
        assert bst.pinned_bytes + bf["optimizer"].pinned_bytes <= BUDGET


def test_async_streamed_save_on_two_ranks_resumes_bitwise(runs: list[dict[str, Any]]) -> None:
    """Each rank's master partition streams from its shard file into its checkpoint file while the
    next steps run; a run without offload loads it and continues as the uninterrupted run."""
    for rank in runs:
        r, whole = rank["streamed_save"], rank["none"]["losses"]
        assert r["lazy"]  # a lazy source over the shard file, not a tensor
        assert r["first"] == whole[:2]
        assert r["during"] == whole[2:4]  # the steps during the save are unaffected by it
        assert r["resumed"] == whole[2:4]
