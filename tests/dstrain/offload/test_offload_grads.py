"""Gradient offload: when ``offload_pinned_bytes`` cannot hold a rank's fp32 gradient shards (stage 3,
parameters and optimizer state on NVMe), the gradients go to an NVMe file too and training stays
bit for bit the run with gradients in memory.

Two real gloo ranks, a 10-layer MLP whose gradient shards (1.3 MB per rank) exceed a 1 MiB budget:
fp32 and bf16, one and two micro-steps per step (the second accumulates into the file: read, add,
write), against stage 3 with nothing offloaded; the gradient file was really written and read, and no
full-size gradient buffer is left in memory. (With a budget that holds them the gradients stay in
memory: test_offload_param's ``both_nvme`` case.)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _dstrain_helpers import TanhStack, scratch_dir, spawn

WIDTH, DEPTH, STEPS, MICRO = 256, 10, 3, 2
BUDGET = 1 << 20  # below the 4 B x 329k elements of gradient shards per rank
EARLY_BUDGET = 1200 << 10  # still below them, and leaves two parameter swap buffers


def _config(
    root: str | None,
    world: int,
    *,
    gas: int = 1,
    bf16: bool = False,
    clip: float = 0.0,
    budget: int = BUDGET,
    early: bool = True,
) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "train_batch_size": MICRO * gas * world,
        "gradient_clipping": clip,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": 1 << 16},
        "steps_per_print": 1000,
    }
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if root is not None:
        z = cfg["zero_optimization"]
        z["offload_param"] = {"device": "nvme", "nvme_path": root, "buffer_count": 3}
        z["offload_optimizer"] = {"device": "nvme", "nvme_path": root, "buffer_count": 2}
        z["offload_optimizer"]["step_in_backward"] = early
        z["offload_pinned_bytes"] = budget
    return cfg


def _run(cfg: dict[str, Any], reads_in_first: bool = False) -> dict[str, Any]:
    """``reads_in_first``: every swap read the optimizer asks for is complete when asked for, so
    which sub-groups step during backward no longer depends on the disk's timing."""
    import torch.distributed as dist

    import dstrain

    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    engine, optimizer = dstrain.initialize(model=TanhStack(WIDTH, DEPTH), config=cfg)[:2]
    if reads_in_first:
        _complete_reads(optimizer)
    gas = engine.config.gradient_accumulation_steps
    losses = []
    try:
        for _ in range(STEPS):
            g = torch.Generator().manual_seed(100)  # the same batch every step: the loss must fall
            x = torch.randn(MICRO * gas * world, WIDTH, generator=g)  # (B, WIDTH), the global batch
            y = torch.randn(MICRO * gas * world, WIDTH, generator=g).tanh()
            for micro in range(gas):
                if reads_in_first:
                    optimizer.drain()  # the m, v read ahead during forward: in before backward
                lo = (micro * world + rank) * MICRO
                loss = engine(x[lo : lo + MICRO], y[lo : lo + MICRO])
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
        store = engine.zero.store
        grads = getattr(store, "grads", None)
        out = {
            "losses": losses,
            "params": [t.clone() for t in engine.full_state_dict().values()],
            "offloaded": grads is not None,
            "grad_resident": sum(g.master_grad.untyped_storage().nbytes() for g in engine.zero.groups),
        }
    finally:
        engine.close()
        if hasattr(optimizer, "close"):
            optimizer.close()
    if grads is not None:
        out["stats"] = grads.statistics()
    if "offload_param" in cfg["zero_optimization"]:
        out["param_stats"] = store.statistics()
        out["opt_stats"] = optimizer.statistics()
    return out


def _complete_reads(optimizer: Any) -> None:
    """Make the m, v, master and gradient reads ``optimizer`` asks for during backward complete
    before it looks at them (`StateReads.fetch_final`), so stepping during backward does not depend on
    the disk's timing (the step's own reads stay asynchronous: waiting there could deadlock)."""
    reads = optimizer.swapped.reads
    fetch_final = reads.fetch_final

    def fetch_and_wait(ready: set[int]) -> None:
        fetch_final(ready)
        for entry in reads.ahead:  # (the m, v reads too: submitted in order, one buffer each)
            for fut in entry[1:4]:
                # a master range assembling from this pass's gathers completes as they come (fp32)
                if fut is not None and not (reads.master is not None and reads.master.assembling(fut)):
                    fut.result()

    reads.fetch_final = fetch_and_wait


def _scenarios(root: str) -> dict[str, Any]:
    def run(name: str, cfg: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        return name, _run(cfg)

    import torch.distributed as dist

    w = dist.get_world_size()
    out = dict(
        [
            run("none", _config(None, w)),
            run("grads_nvme", _config(root, w)),
            run("none_gas2", _config(None, w, gas=2)),
            run("grads_nvme_gas2", _config(root, w, gas=2)),
            run("none_bf16", _config(None, w, bf16=True)),
            run("grads_nvme_bf16", _config(root, w, bf16=True)),
        ]
    )
    # stepping during backward with the master (fp32: the shard file; bf16: its own file) and the
    # gradients swapped, against the same run stepping after backward and against no offload
    for bf16 in (False, True):
        sfx = "_bf16" if bf16 else ""
        for budget, what in ((EARLY_BUDGET, "grads_nvme"), (64 << 20, "paramopt")):
            out[f"{what}_early{sfx}"] = _run(_config(root, w, bf16=bf16, budget=budget), reads_in_first=True)
            out[f"{what}_early_timed{sfx}"] = _run(_config(root, w, bf16=bf16, budget=budget))
            out[f"{what}_late{sfx}"] = _run(_config(root, w, bf16=bf16, budget=budget, early=False))
    out["none_gas2_early"] = out["none_gas2"]
    out["grads_nvme_early_gas2"] = _run(_config(root, w, gas=2, budget=EARLY_BUDGET), reads_in_first=True)
    from dstrain.errors import NotImplementedConfigError

    try:
        _run(_config(root, w, clip=1.0))
        out["clip_error"] = None
    except NotImplementedConfigError as e:
        out["clip_error"] = e.field  # type: ignore[attr-defined]
    return out


@pytest.fixture(scope="module")
def runs() -> Iterator[list[dict[str, Any]]]:
    with scratch_dir("offload-grads-") as root:
        yield spawn(_scenarios, root, world=2, start_method="forkserver")


@pytest.mark.parametrize("name", ["grads_nvme", "grads_nvme_gas2", "grads_nvme_bf16"])
def test_gradients_on_nvme_bitwise_identical_to_memory(runs: list[dict[str, Any]], name: str) -> None:
    base = name.replace("grads_nvme", "none")
    for rank in runs:
        got, ref = rank[name], rank[base]
        assert got["offloaded"] and not ref["offloaded"]
        assert got["losses"] == ref["losses"]  # exact, every micro-step
        assert ref["losses"][-1] < ref["losses"][0]  # it trained
        for a, b in zip(got["params"], ref["params"], strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["grads_nvme", "grads_nvme_gas2"])
def test_gradients_really_swapped(runs: list[dict[str, Any]], name: str) -> None:
    gas = 2 if name.endswith("gas2") else 1
    for rank in runs:
        got = rank[name]
        st, sw = got["stats"], got["stats"].swapper
        assert got["grad_resident"] == 0  # no full-size gradient buffer in memory
        assert st.shard_bytes > BUDGET
        assert st.accumulations == DEPTH * STEPS * gas  # one per unit per micro-step
        # every byte of the shards written at least once per micro-step, read back in every step
        assert sw.written_bytes >= st.shard_bytes * STEPS * gas
        assert sw.read_bytes >= st.shard_bytes * STEPS
        assert st.fetches == got["opt_stats"].sub_groups * STEPS
        if gas == 2:
            assert st.read_modify_writes > 0
        # exported like the other swaps: dstrain_offload_swap_bytes{kind="grad"} (read at scrape time)
        from dstrain.offload.metrics import samples

        names = {(x.name, x.labels.get("direction")) for x in samples(st, 0, kind="grad")}
        assert ("dstrain_offload_swap_bytes", "write") in names
        assert got["param_stats"].pinned_bytes + got["opt_stats"].pinned_bytes <= BUDGET


def test_clipping_with_offloaded_gradients_is_refused(runs: list[dict[str, Any]]) -> None:
    for rank in runs:
        assert rank["clip_error"] == "gradient_clipping"


def test_grad_store_sums_bitwise_and_unwritten_blocks_read_as_zero(tmp_path) -> None:
    """One process, no engine: accumulations over ranges that share pages equal the same add_ calls
    on a resident buffer bit for bit; after `zero`, pages not written again read as zeros although
    the file still holds the last step's bytes; a closed store raises ClosedError."""
    from dsio.errors import ClosedError
    from dstrain.offload.param.grads import OffloadedGrads

    store = OffloadedGrads(str(tmp_path), pinned_budget=256 << 10)
    total = 3 * store.buffer_bytes // 4 + 777  # 3 buffers' worth and a partial one
    store.place(0, total)
    ref = torch.zeros(total)
    g = torch.Generator().manual_seed(0)
    pieces = [(0, 5000), (5000, 20003), (25003, total - 25003)]  # units laid end to end, pages shared
    try:
        for _micro in range(2):  # the second micro-step reads, adds and writes back
            for start, n in pieces:
                values = torch.randn(n, generator=g)
                store.accumulate(0, start, values, 1.0 / 3)
                ref[start : start + n].add_(values, alpha=1.0 / 3)
        per = store.max_numel
        for start in range(0, total, per):
            n = min(per, total - start)
            lease, view = store.fetch(0, start, n).result()
            assert torch.equal(view, ref[start : start + n])
            store.discard(lease).result()
        assert store.statistics().read_modify_writes > 0
        store.zero()  # the next step: only the first unit gets a gradient
        ones = torch.ones(5000)
        store.accumulate(0, 0, ones, 1.0)
        expect = torch.zeros(total)
        expect[:5000] = 1.0  # and zeros elsewhere: stale bytes of the last step are not a gradient
        for start in range(0, total, per):
            n = min(per, total - start)
            lease, view = store.fetch(0, start, n).result()
            assert torch.equal(view, expect[start : start + n])
            store.discard(lease).result()
    finally:
        store.close()
    with pytest.raises(ClosedError):
        store.accumulate(0, 0, ones, 1.0)


EARLY = [
    (f"{what}_{kind}{sfx}", f"none{sfx}")
    for what in ("grads_nvme", "paramopt")
    for kind in ("early", "early_timed", "late")
    for sfx in ("", "_bf16")
] + [("grads_nvme_early_gas2", "none_gas2")]


@pytest.mark.parametrize(("name", "base"), EARLY)
def test_stepping_during_backward_with_master_and_gradients_swapped(
    runs: list[dict[str, Any]], name: str, base: str
) -> None:
    """Parameters and optimizer state on NVMe: sub-groups step during the boundary backward with
    their master and gradient ranges read then, bitwise the same as stepping after backward and as
    no offload (fp32: the master is the shard; bf16: the master file, the shards cast out of order)."""
    for rank in runs:
        got, ref = rank[name], rank[base]
        assert got["offloaded"] == name.startswith("grads_nvme")
        assert got["losses"] == ref["losses"]
        for a, b in zip(got["params"], ref["params"], strict=True):
            assert torch.equal(a, b)
        opt = got["opt_stats"]
        if "_late" in name:
            assert opt.stepped_in_backward == 0
        elif "_timed" not in name:  # reads complete when asked: every final sub-group steps then
            steps = STEPS - 1  # the first step only records how often each unit reduces
            assert opt.stepped_in_backward >= steps * opt.sub_groups // 2 > 0
        # every sub-group's master and gradient are still read once per step
        assert got["param_stats"].master_reads == opt.sub_groups * STEPS
        if got["offloaded"]:
            assert got["stats"].fetches == opt.sub_groups * STEPS
