"""ZeRO-Offload's memory at stage 3 (`dstrain.offload.param.host_master`): with the optimizer on the CPU
or on NVMe (parameters not offloaded) the fp32 master and the gradient partitions live in host memory,
the device keeps the shards.

On this CPU machine the separated layout (``separate=True``, the code path of a GPU run: master and
gradients tensors of their own, each unit's reduced gradient copied out and added there, the stepped
master cast into the shards) trains bit for bit like the resident default, fp32 and bf16, stepping
during backward or after it, with m and v in host memory or swapped from NVMe. Under ``-m gpu`` the
same run on CUDA keeps the master and gradients on the host and the GPU holds fewer bytes per
parameter than with them on the GPU, for both optimizer devices."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _dstrain_helpers import engine_losses, make_model
from _offload_helpers import offload_config, train_drained

pytest.importorskip("dsio._C", reason="dsio's native core is not built here")

import dstrain  # noqa: E402
import dstrain.offload.compose as compose  # noqa: E402
from dstrain.offload.param.host_master import HostMasterShards  # noqa: E402

STEPS = 4


def _train(cfg: dict[str, Any], monkeypatch: Any, store: Any = None, device: str = "cpu") -> dict[str, Any]:
    def measure(engine: Any) -> dict[str, Any]:
        groups = engine.zero.groups
        return {
            "master_devices": {g.master.device.type for g in groups},
            "shard_devices": {g.shards.device.type for g in groups},
            "apart": all(g.master.data_ptr() != g.shards.data_ptr() for g in groups),
            "pinned": all(g.master.is_pinned() and g.master_grad.is_pinned() for g in groups),
            # parameter elements gathered beyond the shards at the peak (world size 1: none)
            "gathered": engine.zero.statistics().peak_resident_param_numel - sum(g.total for g in groups),
        }

    if store is not None:
        monkeypatch.setattr(compose, "build_param_store", lambda *a, **k: store)
    try:
        return train_drained(cfg, make_model().to(device), STEPS, measure)
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("early", [True, False])
@pytest.mark.parametrize("optimizer", ["cpu", "nvme"])
def test_separated_master_and_gradients_train_bitwise_like_resident(
    monkeypatch, tmp_path, bf16, early, optimizer
) -> None:
    cfg = offload_config(3, optimizer, str(tmp_path), sub_group=1024, bf16=bf16)
    cfg["zero_optimization"]["offload_optimizer"]["step_in_backward"] = early
    ref = _train(cfg, monkeypatch)  # composed: HostMasterShards, nothing separated on a CPU run
    assert not ref["apart"] or bf16  # fp32: the master aliases the shards as in the resident default
    got = _train(cfg, monkeypatch, HostMasterShards(separate=True))
    assert got["apart"] and got["master_devices"] == got["grad_devices"] == {"cpu"}
    assert got["gathered"] == ref["gathered"] == 0  # world size 1: the passes bound to the shards
    assert got["losses"] == ref["losses"]
    assert ref["losses"][-1] < ref["losses"][0]  # it trained
    for a, b in zip(got["params"], ref["params"], strict=True):
        assert torch.equal(a, b)
    assert (got["early"] > 0) == early  # sub-groups step during backward on the host too


def test_composed_for_the_optimizer_offloaded_alone(tmp_path) -> None:
    """The optimizer on the CPU or on NVMe with parameters resident: the host master; parameters
    offloaded too, or nothing offloaded: not."""
    from dstrain.config import DSConfig

    def store(optimizer: str, **param: Any) -> Any:
        cfg = offload_config(3, optimizer, str(tmp_path), sub_group=1024)
        if param:
            cfg["zero_optimization"]["offload_param"] = param
        zc = DSConfig.load(cfg).zero_optimization
        return compose.build_param_store(zc, torch.float32)

    assert isinstance(store("cpu"), HostMasterShards)
    assert isinstance(store("nvme"), HostMasterShards)
    assert store("none") is None
    for optimizer in ("cpu", "nvme"):
        both = store(optimizer, device="cpu")
        assert both is not None and not isinstance(both, HostMasterShards)
        both.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("optimizer", ["cpu", "nvme"])
def test_on_cuda_master_and_gradients_live_on_the_host(monkeypatch, tmp_path, bf16, optimizer) -> None:
    """The master and gradients are page-locked host tensors, the shards stay on the GPU, and the GPU
    peak bytes per parameter are below the same run's with the master and gradients on the GPU (the
    resident store), optimizer state on the CPU or on NVMe; the losses agree within the rounding of
    CPU vs CUDA Adam."""
    from dstrain.zero.units import ShardStore

    cfg = offload_config(3, optimizer, str(tmp_path), sub_group=1024, bf16=bf16)
    cfg["zero_optimization"]["offload_optimizer"]["pin_memory"] = True
    got = _train(cfg, monkeypatch, device="cuda")
    assert got["master_devices"] == got["grad_devices"] == {"cpu"} and got["shard_devices"] == {"cuda"}
    assert got["pinned"] and got["apart"]
    assert got["gathered"] == 0  # a pass binds the parameters to the GPU's shards: no gathered copies
    ref = _train(cfg, monkeypatch, ShardStore(), device="cuda")
    assert ref["master_devices"] == ref["grad_devices"] == {"cuda"}
    numel = sum(p.numel() for p in make_model().parameters())
    assert got["gpu_peak"] / numel < ref["gpu_peak"] / numel  # bytes per parameter
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-2 if bf16 else 1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_staged_copies_between_host_and_device_are_exact(monkeypatch, dtype) -> None:
    """The copies through page-locked staging (gradients out, stepped master back) in several pieces
    each, both staging buffers in turn: the same values as the plain cross-device ops they replace."""
    import dstrain.offload.param.host_master as hm
    from dstrain.zero.units import ShardStore

    monkeypatch.setattr(hm, "STAGE_BYTES", 4096)  # 1,024 fp32 / 2,048 half elements a piece
    store = HostMasterShards(pin_memory=True)
    g = torch.Generator().manual_seed(0)
    grad = torch.randn(10_001, generator=g).to(dtype).cuda()  # 10 pieces and a tail
    target = torch.randn(10_001, generator=g).pin_memory()
    want = target.clone()
    ShardStore().add_grad(want, grad, 0.5)  # the plain path: .to() then add_
    store.add_grad(target, grad, 0.5)
    assert torch.equal(target, want)

    class Group:  # what after_step reads of a ShardGroup
        total = 10_001
        shards = torch.zeros(10_001, dtype=dtype, device="cuda")
        master = torch.randn(10_001, generator=g).pin_memory()
        device = torch.device("cuda")
        alias = False

    store.after_step(Group)  # type: ignore[arg-type]
    assert torch.equal(Group.shards.cpu(), Group.master.to(dtype))
    assert store.pinned_bytes == 2 * 4096


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("alpha", [1.0, 0.5])
def test_a_put_gradient_lands_in_page_locked_memory_exactly_without_staging(
    monkeypatch, dtype, alpha
) -> None:
    """`HostMasterShards.put_grad` (the first gradient of a window): upcast on the device a piece at a
    time and copied straight into the page-locked partition, queued: once its handle is waited the
    host range holds the values the staged add gives to zeros, and no staging buffer was made."""
    import dstrain.offload.param.host_master as hm

    monkeypatch.setattr(hm, "PUT_BYTES", 4096)  # 1,024 fp32 elements a piece
    store = HostMasterShards(pin_memory=True)
    g = torch.Generator().manual_seed(2)
    grad = torch.randn(10_001, generator=g).to(dtype).cuda()  # 10 pieces and a tail
    target = torch.zeros(10_001).pin_memory()
    want = torch.zeros(10_001)
    HostMasterShards(pin_memory=True).add_grad(want, grad, alpha)  # the staged add onto zeros
    store.put_grad(target, grad, alpha).wait()
    assert torch.equal(target, want)
    assert store.pinned_bytes == 0  # no staging: the copies went straight into the partition


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_cast_back_waits_once_a_step(monkeypatch) -> None:
    """Each group's cast back is queued (`after_step`); the stream is waited once, at `step_done`, after
    the last group, and then every group's shards hold its master."""
    import dstrain.offload.param.host_master as hm

    monkeypatch.setattr(hm, "STAGE_BYTES", 4096)
    waits = {"n": 0}
    # Counted on torch's own classes, not through a stand-in stream: torch's `Event.record` (2.11 and
    # later) refuses any object that is not a real stream. A whole-device synchronize counts too.
    stream_sync, device_sync = torch.cuda.Stream.synchronize, torch.cuda.synchronize

    def counted_stream_sync(self: torch.cuda.Stream) -> None:
        waits["n"] += 1
        stream_sync(self)

    def counted_device_sync(*a: Any, **k: Any) -> None:
        waits["n"] += 1
        device_sync(*a, **k)

    monkeypatch.setattr(torch.cuda.Stream, "synchronize", counted_stream_sync)
    monkeypatch.setattr(torch.cuda, "synchronize", counted_device_sync)
    store = HostMasterShards(pin_memory=True)
    g = torch.Generator().manual_seed(1)

    def group() -> Any:
        class Group:
            total = 5_000
            shards = torch.zeros(5_000, dtype=torch.bfloat16, device="cuda")
            master = torch.randn(5_000, generator=g).pin_memory()
            device = torch.device("cuda")
            alias = False

        return Group

    groups = [group() for _ in range(3)]
    for gr in groups:
        store.after_step(gr)  # type: ignore[arg-type]
    assert waits["n"] == 0
    store.step_done()
    assert waits["n"] == 1
    for gr in groups:
        assert torch.equal(gr.shards.cpu(), gr.master.to(torch.bfloat16))
    store.step_done()  # nothing queued: no wait
    assert waits["n"] == 1


def test_each_optimizer_step_ends_with_one_step_done_after_every_groups_cast(monkeypatch, tmp_path) -> None:
    """`HostMasterShards.after_step` only queues a group's cast back on a GPU; the stage-3 strategy must
    call `step_done` (the one wait) once a step, after the last group's cast and before any gather
    reads the shards. Recorded through a real engine (the separated layout on this CPU)."""
    events: list[str] = []

    class Recording(HostMasterShards):
        def after_step(self, group: Any) -> None:
            events.append("cast")
            super().after_step(group)

        def step_done(self) -> None:
            events.append("done")
            super().step_done()

    cfg = offload_config(3, "cpu", str(tmp_path), sub_group=1024, bf16=True)
    store = Recording(separate=True, pin_memory=False)
    monkeypatch.setattr(compose, "build_param_store", lambda *a, **k: store)
    engine = dstrain.initialize(model=make_model(), config=cfg)[0]
    try:
        groups = len(engine.zero.groups)
        engine_losses(engine, 2)
    finally:
        engine.close()
    assert groups >= 1
    assert events == (["cast"] * groups + ["done"]) * 2


@pytest.mark.parametrize("bf16", [False, True])
def test_world1_gradients_reach_the_store_as_autograd_made_them(monkeypatch, tmp_path, bf16) -> None:
    """World size 1: the reduction is the identity, so no flat copy of a unit's gradients and no
    reduce-scatter output (each a copy of every gradient, which the reduction queue held for
    overlap): each parameter's own gradient tensor is handed to the store, put into its zeroed range
    on the first micro-step of a window and added on the next; training is bitwise unchanged (the
    bitwise test above compares with the resident store, test_zero_parity with stage 0)."""
    made: dict[int, int] = {}  # parameter -> the data pointer of the gradient autograd made last
    calls: list[tuple[str, int, bool]] = []

    class Recording(HostMasterShards):
        putting = False

        def put_grad(self, target: torch.Tensor, grad: torch.Tensor, alpha: float) -> Any:
            calls.append(("put", grad.numel(), grad.data_ptr() in made.values()))
            self.putting = True  # (on a CPU run the put adds: not recorded twice)
            try:
                return super().put_grad(target, grad, alpha)
            finally:
                self.putting = False

        def add_grad(self, target: torch.Tensor, grad: torch.Tensor, alpha: float) -> None:
            if not self.putting:
                calls.append(("add", grad.numel(), grad.data_ptr() in made.values()))
            super().add_grad(target, grad, alpha)

    cfg = offload_config(3, "cpu", str(tmp_path), sub_group=1024, bf16=bf16)
    cfg["gradient_accumulation_steps"] = 2
    cfg["train_batch_size"] *= 2
    model = make_model()
    numels = sorted(p.numel() for p in model.parameters())
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(
            lambda q: made.__setitem__(id(q), q.grad.data_ptr())
        )  # before dstrain's
    store = Recording(separate=True, pin_memory=False)
    monkeypatch.setattr(compose, "build_param_store", lambda *a, **k: store)
    engine = dstrain.initialize(model=model, config=cfg)[0]
    try:
        engine_losses(engine, 1)
    finally:
        engine.close()
    puts = [c for c in calls if c[0] == "put"]
    adds = [c for c in calls if c[0] == "add"]
    assert calls == puts + adds  # the first micro-step puts, the second adds
    assert sorted(n for _, n, _ in puts) == numels  # one put per parameter, not one per unit
    assert all(own for _, _, own in puts + adds)  # the parameters' own gradients, no copies
    assert sorted(n for _, n, _ in adds) == numels  # the second micro-step adds
