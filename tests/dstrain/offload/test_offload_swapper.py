"""`Swapper` (slots of one swap file <-> a bounded pinned pool) and `OffloadAdam` on real files."""

from __future__ import annotations

import os
import threading

import pytest
import torch

pytest.importorskip("dsio._C", reason="dsio's native core is not built here")

from dstrain.errors import ConfigError  # noqa: E402
from dstrain.offload.optimizer.adam import OffloadAdam, plan_sub_groups  # noqa: E402
from dstrain.offload.swap.swapper import Swapper  # noqa: E402


def test_roundtrip_and_slot_layout(tmp_path) -> None:
    sw = Swapper(tmp_path, "optimizer", buffer_bytes=3 * 4096, buffer_count=2)
    try:
        offsets = [sw.reserve(k, n) for k, n in (("a", 10), ("b", 4096), ("c", 8193))]
        assert offsets == [0, 4096, 8192]  # page-aligned, each slot whole pages
        with pytest.raises(KeyError):
            sw.reserve("a", 1)
        with pytest.raises(ValueError):
            sw.reserve("big", 3 * 4096 + 1)  # larger than a buffer
        for key, fill in (("a", 1), ("b", 2), ("c", 3)):
            lease = sw.acquire(key).result()
            lease.tensor.fill_(fill)
            sw.store(lease)
        for key, fill in (("c", 3), ("a", 1), ("b", 2)):
            lease = sw.fetch(key).result()  # waits for the write of the same slot still in flight
            n = sw.slot_bytes(key)
            assert bool((lease.tensor[:n] == fill).all())
            sw.discard(lease).result()
        st = sw.statistics()
        assert st.o_direct == (os.path.exists(sw.path) and st.o_direct)
        assert (st.reads, st.writes) == (3, 3)
        assert st.read_bytes == st.written_bytes == 4096 + 4096 + 3 * 4096
        assert st.buffers == 2 and st.peak_buffers_in_use <= 2 and st.buffers_in_use == 0
        assert st.pinned_bytes == 2 * 3 * 4096 + 64 * 1024
        path = sw.path
    finally:
        sw.close()
    assert not os.path.exists(os.path.dirname(path))  # the private swap directory is gone
    with pytest.raises(Exception):  # noqa: B017 - ClosedError from dsio
        sw.fetch("a")


def test_reads_see_the_latest_write_under_backpressure(tmp_path) -> None:
    """One buffer, many slots, writes and reads interleaved from the training thread: every read
    returns the last value written to its slot (never a stale page), and nothing deadlocks."""
    sw = Swapper(tmp_path, "param", buffer_bytes=4096, buffer_count=1)
    try:
        for k in range(8):
            sw.reserve(k, 4096)
        for rnd in range(1, 4):
            for k in range(8):
                lease = sw.acquire(k).result(timeout=30)
                lease.tensor.fill_(rnd * 10 + k)
                sw.store(lease)
            for k in reversed(range(8)):
                lease = sw.fetch(k).result(timeout=30)
                assert int(lease.tensor[0]) == rnd * 10 + k and int(lease.tensor[-1]) == rnd * 10 + k
                sw.discard(lease)
        sw.drain(timeout=30)
        assert sw.statistics().peak_buffers_in_use == 1
    finally:
        sw.close()


def test_double_handback_is_an_error(tmp_path) -> None:
    sw = Swapper(tmp_path, "optimizer", buffer_bytes=4096, buffer_count=1)
    try:
        sw.reserve(0, 4096)
        lease = sw.acquire(0).result()
        sw.discard(lease).result()
        with pytest.raises(RuntimeError):
            sw.discard(lease).result()
    finally:
        sw.close()


def test_plan_shrinks_sub_groups_to_the_budget() -> None:
    # 10M elements, m+v = 8 bytes each: 4 buffers of 10M would need 320 MB; the budget is 8 MiB
    size, buffers = plan_sub_groups([10_000_000], 1_000_000_000, 8 << 20, 4, 8)
    assert size % 1024 == 0 and buffers >= 4
    assert buffers * size * 8 <= 8 << 20
    # a budget that holds everything: one buffer per sub-group, no more
    size, buffers = plan_sub_groups([5000, 3000], 2048, 1 << 30, 4, 8)
    assert size == 2048 and buffers == 3 + 2
    with pytest.raises(ConfigError):
        plan_sub_groups([10_000], 1_000_000, 1000, 4, 8)  # not even one smallest buffer


def _views(n: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(0)
    master, grad = torch.randn(n), torch.zeros(n)
    views = []
    for s in range(0, n, chunk):
        v = master[s : s + chunk]
        v.requires_grad_(True)
        v.grad = grad[s : s + chunk]
        views.append(v)
    return master, grad, views


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_offload_adam_matches_torch_fused_adamw_bitwise(tmp_path, device: str) -> None:
    """Two param groups (different LRs), sub-groups of 3072 cutting views of 20000 elements,
    a tight budget (2 buffers for 17 sub-groups): bit-for-bit torch's fused AdamW, and its state
    dict loads into torch's optimizer."""
    n = 50_003
    results = {}
    for kind in ("torch", device):
        master, grad, views = _views(n, 20_000)
        groups = [{"params": views[:2]}, {"params": views[2:], "lr": 3e-3}]
        if kind == "torch":
            opt: torch.optim.Optimizer = torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.01, fused=True)
        else:
            opt = OffloadAdam(
                groups,
                device=device,
                lr=1e-2,
                weight_decay=0.01,
                sub_group_size=3000,
                nvme_path=str(tmp_path),
                buffer_count=2,
                pinned_budget=2 * 2 * 3072 * 4 + (64 << 10),
            )
        for it in range(4):
            grad.copy_(torch.randn(n, generator=torch.Generator().manual_seed(it)))
            opt.step()
        results[kind] = (master.clone(), opt.state_dict())
        if kind != "torch":
            st = opt.statistics()
            if device == "nvme":
                assert st.swapper is not None and st.swapper.buffers == 2
                assert st.pinned_bytes <= st.pinned_budget
                assert st.prefetch_hits + st.prefetch_misses == 4 * st.sub_groups
            opt.close()  # type: ignore[attr-defined]
    assert torch.equal(results["torch"][0], results[device][0])
    ref_state, got_state = results["torch"][1]["state"], results[device][1]["state"]
    assert ref_state.keys() == got_state.keys()
    for i in ref_state:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(ref_state[i][key], got_state[i][key])


def test_offload_adam_load_state_dict_continues_bitwise(tmp_path) -> None:
    """Train 3 steps with torch's AdamW, move its state into an NVMe OffloadAdam, train 3 more:
    same result as 6 steps of torch's."""
    n = 9000
    master_a, grad_a, views_a = _views(n, 5000)
    ref = torch.optim.AdamW(views_a, lr=1e-2, fused=True)
    master_b, grad_b, views_b = _views(n, 5000)
    first = torch.optim.AdamW(views_b, lr=1e-2, fused=True)
    for it in range(6):
        g = torch.randn(n, generator=torch.Generator().manual_seed(it))
        grad_a.copy_(g)
        ref.step()
        if it < 3:
            grad_b.copy_(g)
            first.step()
        elif it == 3:
            off = OffloadAdam(views_b, device="nvme", lr=5.0, nvme_path=str(tmp_path), sub_group_size=2048)
            off.load_state_dict(first.state_dict())  # lr comes from the saved param groups
            grad_b.copy_(g)
            off.step()
        else:
            grad_b.copy_(g)
            off.step()
    off.close()
    assert torch.equal(master_a, master_b)


def test_close_from_exit_hook_does_not_hang(tmp_path) -> None:
    """An optimizer never closed: dropping it closes its swapper (no thread or file left)."""
    _, _, views = _views(4096, 4096)
    before = threading.active_count()
    off = OffloadAdam(views, device="nvme", nvme_path=str(tmp_path))
    path = off.statistics().swapper.path  # type: ignore[union-attr]
    del off
    import gc

    gc.collect()
    assert not os.path.exists(path)
    assert threading.active_count() <= before + 1  # the shared loop thread may have started


def test_offload_metrics_on_dsio_exporter(tmp_path) -> None:
    """dstrain_offload_* values come from the stepper's statistics at scrape time, and go at close."""
    prometheus_client = pytest.importorskip("prometheus_client")
    import gc

    from dsio import metrics

    # a part built by hand has no engine (engine=":N", the smallest number free): one an earlier test
    # dropped unclosed, in a reference cycle, would hold ":0" until collected
    gc.collect()
    registry = prometheus_client.CollectorRegistry()
    metrics.register(registry)
    _, grad, views = _views(9000, 9000)
    off = OffloadAdam(views, device="nvme", nvme_path=str(tmp_path), sub_group_size=4096, buffer_count=2)
    for _ in range(2):
        grad.normal_()
        off.step()
    off.swapped.swapper.drain()  # type: ignore[union-attr]  # the last writes are behind
    st = off.statistics()
    labels = {"rank": "0", "engine": ":0", "kind": "optimizer"}  # built by hand: no engine owns it

    def value(name: str, **extra: str) -> float | None:
        return registry.get_sample_value(name, {**labels, **extra})

    assert st.swapper is not None
    assert value("dstrain_offload_swap_bytes_total", direction="write") == st.swapper.written_bytes > 0
    assert value("dstrain_offload_swap_bytes_total", direction="read") == st.swapper.read_bytes > 0
    hits, misses = (
        value("dstrain_offload_prefetch_total", result="hit"),
        value("dstrain_offload_prefetch_total", result="miss"),
    )
    assert hits is not None and misses is not None and hits + misses == 2 * st.sub_groups
    assert (
        value("dstrain_offload_pinned_bytes")
        == st.pinned_bytes
        <= value("dstrain_offload_pinned_budget_bytes")
    )
    assert value("dstrain_offload_stall_seconds_total") == st.stall_seconds
    off.close()
    assert value("dstrain_offload_pinned_bytes") is None  # gone with the stepper


def test_zero_grad_keeps_the_gradient_buffers_attached() -> None:
    master, grad, views = _views(5000, 5000)
    off = OffloadAdam(views, device="cpu", lr=0.1)
    grad.fill_(1.0)
    off.zero_grad()  # a DeepSpeed-style loop may call it; ZeRO owns (and zeroes) the gradients
    before = master.clone()
    off.step()
    assert views[0].grad is not None and not torch.equal(master, before)
    off.close()


# -- copy-on-write versions (pinned by checkpoint saves) ------------------------------------------


def _write(sw: Swapper, key: object, value: int) -> None:
    lease = sw.acquire(key).result(timeout=30)
    lease.tensor.fill_(value)
    sw.store(lease)


def _read(sw: Swapper, key: object) -> int:
    lease = sw.fetch(key).result(timeout=30)
    try:
        first, last = int(lease.tensor[0]), int(lease.tensor[sw.slot_bytes(key) - 1])
        assert first == last
        return first
    finally:
        sw.discard(lease).result(timeout=30)


def _on_disk(region: tuple[str, int, int]) -> set[int]:
    path, offset, size = region
    with open(path, "rb") as f:
        f.seek(offset)
        return set(f.read(size))


def test_a_pinned_version_outlives_later_writes_and_its_region_is_reused(tmp_path) -> None:
    """Writes after a pin go around the pinned version (reads see the new bytes, the pinned region
    keeps the old ones); released, the old regions become spares that the next pin's writes reuse,
    so the file grows once, by the pinned bytes, and never again."""
    sw = Swapper(tmp_path, "optimizer", buffer_bytes=2 * 4096, buffer_count=2)
    try:
        for k in range(3):
            sw.reserve(k, 2 * 4096)
        base = sw.statistics().file_bytes
        for k in range(3):
            _write(sw, k, 1)
        pin = sw.pin()
        for k in range(3):
            _write(sw, k, 2)
        sw.drain(timeout=30)
        assert [_read(sw, k) for k in range(3)] == [2, 2, 2]  # the step reads the current version
        assert all(_on_disk(pin.region(k)) == {1} for k in range(3))  # the save reads the old one
        st = sw.statistics().versions
        assert st is not None and (st.pins, st.relocations, st.grown_bytes) == (1, 3, 3 * 2 * 4096)
        for k in range(3):
            _write(sw, k, 3)  # the new versions are not pinned: written in place
        sw.drain(timeout=30)
        assert sw.statistics().versions.relocations == 3  # type: ignore[union-attr]
        pin.release()
        pin.release()  # idempotent
        st = sw.statistics().versions
        assert st is not None and st.pins == 0 and st.spare_bytes == 3 * 2 * 4096
        for rnd in range(4, 12):  # many more saves: the spares take every relocation
            pin = sw.pin()
            for k in range(3):
                _write(sw, k, rnd)
            sw.drain(timeout=30)
            assert all(_on_disk(pin.region(k)) == {rnd - 1} for k in range(3))
            pin.release()
            assert [_read(sw, k) for k in range(3)] == [rnd] * 3
        st = sw.statistics().versions
        assert st is not None and st.grown_bytes == 3 * 2 * 4096 and st.relocations == 3 + 8 * 3
        assert sw.statistics().file_bytes == base + 3 * 2 * 4096
        assert os.path.getsize(sw.path) <= base + 3 * 2 * 4096
        held = sw.pin([0])
    finally:
        sw.close()
    assert held.released  # close lets every pin go
    with pytest.raises(Exception):  # noqa: B017 - ClosedError from dsio
        sw.pin()


def test_a_spare_with_a_transfer_in_flight_is_not_handed_out() -> None:
    """An old version's write still in flight when its pin is released: its region must not take a
    new version (the late write would land on top of it) until that write is done."""
    from dstrain.offload.swap.slots import SlotTable

    t = SlotTable("swap")
    a, b = t.reserve("k", 4096), t.reserve("j", 4096)
    first, _ = t.for_write("k")  # in flight
    assert first == a
    pin = t.pin(["k"])
    moved, _ = t.for_write("k")  # around the pinned version: a new region
    assert moved not in (a, b)
    t.done(moved)
    pin.release()  # region a is free, but its write is still in flight
    other = t.pin(["j"])
    j_moved, _ = t.for_write("j")
    assert j_moved != a  # not the busy spare
    t.done(j_moved)
    t.done(first)  # the old write is done now
    again = t.pin(["k"])
    k_moved, _ = t.for_write("k")
    assert k_moved == a  # now the spare is taken
    t.done(k_moved)
    other.release()
    again.release()
    assert t.statistics().pins == 0


def test_swap_buffers_are_on_huge_pages(tmp_path) -> None:
    """The swap buffers sit on transparent huge pages (2 MiB physically contiguous steps), so the
    O_DIRECT pieces of a buffer merge into large device requests: measured 2.23 vs 1.81 GB/s for
    32 MiB swap reads (bench/results/swap-pool-hugepage-ab-2026-11-30.md)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
    except OSError:
        pytest.skip("no transparent huge pages here")
    if "[never]" in mode:
        pytest.skip("transparent huge pages are off here ([never])")
    sw = Swapper(tmp_path, "optimizer", buffer_bytes=2 << 20, buffer_count=2)
    try:
        st = sw._pool.statistics()
        assert st.hugepages and st.buffers == 2
    finally:
        sw.close()


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_a_param_group_added_after_construction_is_refused(tmp_path, device: str) -> None:
    """torch's ``add_param_group`` after construction: the sub-groups and their state are planned at
    construction, so the new group's parameters would never be stepped (they stayed as they were while
    the others trained): refused, typed, and the optimizer is unchanged."""
    from dstrain.errors import NotImplementedConfigError

    _, grad, views = _views(5000, 5000)
    extra = torch.zeros(2048, requires_grad=True)
    extra.grad = torch.ones(2048)
    off = OffloadAdam(views, device=device, nvme_path=str(tmp_path), lr=0.1)
    try:
        with pytest.raises(NotImplementedConfigError):
            off.add_param_group({"params": [extra]})
        assert len(off.param_groups) == 1
    finally:
        off.close()
    two = OffloadAdam([{"params": views}, {"params": [extra], "lr": 0.5}], device="cpu")  # at construction
    grad.fill_(1.0)
    two.step()
    assert extra.abs().sum() > 0
    two.close()


@pytest.mark.parametrize(
    "bad",
    [
        {"device": "nvme", "nvme_path": None},
        {"lr": -1.0},
        {"betas": (1.5, 0.999)},
        {"betas": (0.9, -0.1)},
        {"eps": -1e-8},
        {"weight_decay": -0.1},
        {"sub_group_size": 0},
        {"buffer_count": 0},
    ],
)
def test_bad_arguments_are_refused_typed(tmp_path, bad: dict) -> None:
    """A hand-built `OffloadAdam`'s arguments are checked as torch's Adam checks its own: `ConfigError`
    (a ValueError, naming the key), not an AssertionError or a run that trains with a negative learning
    rate."""
    from dstrain.errors import ConfigError

    _, _, views = _views(5000, 5000)
    kwargs: dict = {"device": "cpu", "nvme_path": str(tmp_path), **bad}
    with pytest.raises(ConfigError):
        OffloadAdam(views, **kwargs).close()
