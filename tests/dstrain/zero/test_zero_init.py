"""``dstrain.zero.Init``: models built partitioned, bitwise the same as built whole, adopted by
``initialize`` without re-materializing; GatheredParameters, external parameters, bad input."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from _dstrain_helpers import SEQ, VOCAB, Tiny, base_config, engine_losses, make_model, scratch_dir, spawn
from _mount import mounted
from torch import nn

import dstrain
from dstrain.errors import ConfigError, InitError, InsufficientDiskError
from dstrain.zero import GatheredParameters, Init, register_external_parameter
from dstrain.zero.init import is_partitioned

STEPS = 3


def _config(offload: str, root: str | None, world: int, stage: int = 3) -> dict[str, Any]:
    cfg = base_config(stage, world=world, micro=2)
    z = cfg["zero_optimization"]
    if offload == "cpu":
        z["offload_param"] = {"device": "cpu"}
        z["offload_optimizer"] = {"device": "cpu"}
    elif offload == "nvme":
        z["offload_param"] = {"device": "nvme", "nvme_path": root}
        z["offload_optimizer"] = {"device": "nvme", "nvme_path": root}
        z["sub_group_size"] = 1 << 16
    return cfg


def _values(model: nn.Module) -> dict[str, torch.Tensor]:
    with GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _build(cls: Any, cfg: dict[str, Any] | None, **init: Any) -> tuple[nn.Module, Any, torch.Tensor]:
    """``cls()`` with seed 0, under Init when ``cfg`` is given; (model, Init, RNG state after)."""
    torch.manual_seed(0)
    if cfg is None:
        return cls(), None, torch.get_rng_state()
    with Init(config_dict_or_path=cfg, **init) as zi:
        model = cls()
    return model, zi, torch.get_rng_state()


def _parity(offload: str) -> dict[str, Any]:
    """Normal build vs Init build on this rank: values, RNG, shard sizes, losses."""
    with scratch_dir("zinit-") as root:
        return _parity_in(offload, root)


def _parity_in(offload: str, root: str) -> dict[str, Any]:
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    cfg = _config(offload, root, world)
    whole, _, rng_whole = _build(Tiny, None)
    ref_values = {n: p.detach().clone() for n, p in whole.named_parameters()}
    engine = dstrain.initialize(model=whole, config=cfg)[0]
    ref_losses = engine_losses(engine, STEPS)
    engine.close()
    model, zi, rng_init = _build(Tiny, cfg)
    stats = zi.statistics()
    partitioned = all(is_partitioned(p) for p in model.parameters())
    resident = sum(p.untyped_storage().nbytes() for p in model.parameters())
    init_values = _values(model)
    files_during = sorted(os.listdir(root))
    engine = dstrain.initialize(model=model, config=cfg)[0]
    files_after = sorted(f for f in os.listdir(root) if f.startswith("zero_init"))
    adopted = not any(is_partitioned(p) for p in model.parameters())
    losses = engine_losses(engine, STEPS)
    engine.close()
    return {
        "ref_losses": ref_losses,
        "losses": losses,
        "values_equal": all(torch.equal(init_values[n], v) for n, v in ref_values.items()),
        "rng_equal": torch.equal(rng_whole, rng_init),
        "partitioned": partitioned,
        "adopted": adopted,
        "resident_bytes": resident,
        "stats": stats,
        "files_during": files_during,
        "init_files_after": files_after,
        "world": world,
    }


@pytest.fixture(scope="module")
def world2() -> list[dict[str, Any]]:
    return spawn(_parity_all, world=2, start_method="forkserver")


def _parity_all() -> dict[str, Any]:
    return {k: _parity(k) for k in ("none", "cpu", "nvme")}


@pytest.mark.parametrize("offload", ["none", "cpu", "nvme"])
@pytest.mark.parametrize("rank", [0, 1])
def test_init_losses_bitwise_equal_normal_build(
    world2: list[dict[str, Any]], offload: str, rank: int
) -> None:
    out = world2[rank][offload]
    assert out["world"] == 2
    assert out["losses"] == out["ref_losses"]  # bitwise: the same fp32 arithmetic on the same shards
    assert out["values_equal"] and out["rng_equal"]  # same initializers, same RNG consumption
    assert out["partitioned"] and out["adopted"]
    assert out["init_files_after"] == []  # Init's swap file goes once the engine adopted the shards


@pytest.mark.parametrize("rank", [0, 1])
def test_rank_keeps_only_its_shard(world2: list[dict[str, Any]], rank: int) -> None:
    numel = sum(p.numel() for p in make_model().parameters())  # tied: the embedding once
    for offload, where in (("none", "device"), ("cpu", "cpu"), ("nvme", "nvme")):
        st = world2[rank][offload]["stats"]
        assert st.numel == numel
        # each unit padded to a multiple of 2, this rank's half, fp32
        assert numel * 4 // 2 <= st.shard_bytes[where] <= (numel + 2 * st.units) * 4 // 2
        assert sum(st.shard_bytes.values()) == st.shard_bytes[where]
        # placeholders: one element per parameter, whatever its size
        assert world2[rank][offload]["resident_bytes"] <= 4 * st.params
    st = world2[rank]["none"]["stats"]
    assert st.largest_module_numel == 4 * 16 * 16 + 4 * 16  # the MLP's first Linear, built whole once
    assert any(f.startswith("zero_init") for f in world2[rank]["nvme"]["files_during"])


# -- what modules do while they are built ----------------------------------------------------------


class _Gained(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.gain  # (B, T, C); ``gain`` is given by the parent


class _Parented(nn.Module):
    """A parent that gives its child a parameter after the child was built, a buffer, a frozen weight."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.child = _Gained(16, 16)
        self.child.gain = nn.Parameter(torch.randn(16))  # a parameter of another module
        self.register_buffer("scale", torch.full((16,), 0.5))
        self.frozen = nn.Linear(16, 16)
        self.frozen.weight.requires_grad_(False)
        self.head = nn.Linear(16, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)  # (B, T, C)
        x = self.frozen(self.child(x) * self.scale)
        return nn.functional.cross_entropy(self.head(x).reshape(-1, VOCAB), targets.reshape(-1))


class _UsesOther(nn.Module):
    """``mix``'s forward uses ``emb``'s weight (registered as an external parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.mix = _Mix(self.emb)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.mix(self.emb(idx))  # (B, T, V)
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


class _Mix(nn.Module):
    def __init__(self, emb: nn.Embedding) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self._emb = [emb]  # not a submodule: its weight belongs to the parent's emb
        register_external_parameter(self, emb.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) @ self._emb[0].weight.t()  # (B, T, V)


class _RootUsesChild(nn.Module):
    """The root's forward uses ``emb``'s weight after ``emb``'s own forward returned (a GPT head tied
    to the embedding, written as ``F.linear(x, self.emb.weight)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.ln = nn.LayerNorm(16)
        register_external_parameter(self, self.emb.weight)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = nn.functional.linear(self.ln(self.emb(idx)), self.emb.weight)  # (B, T, V)
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def _features(cls: Any, stage: int) -> dict[str, Any]:
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    cfg = _config("none", None, world, stage=stage)
    whole, _, _ = _build(cls, None)
    ref = {n: p.detach().clone() for n, p in whole.named_parameters()}
    e = dstrain.initialize(model=whole, config=cfg)[0]
    ref_losses = engine_losses(e, STEPS)
    e.close()
    model, zi, _ = _build(cls, cfg)
    values = _values(model)
    e = dstrain.initialize(model=model, config=cfg)[0]
    losses = engine_losses(e, STEPS)
    with GatheredParameters(list(e.module.parameters())):  # an engine's units, gathered for reading
        gathered_ok = all(p.untyped_storage().nbytes() > 0 for p in e.module.parameters())
    e.close()
    return {
        "values_equal": all(torch.equal(values[n], v) for n, v in ref.items()),
        "losses": losses,
        "ref_losses": ref_losses,
        "gathered_ok": gathered_ok,
        "units": zi.statistics().units,
    }


def _features_all() -> dict[str, Any]:
    return {
        "parented": _features(_Parented, 3),
        "external": _features(_UsesOther, 3),
        "root_uses_child": _features(_RootUsesChild, 3),
        "tied_stage1": _features(Tiny, 1),
    }


@pytest.fixture(scope="module")
def features2() -> list[dict[str, Any]]:
    return spawn(_features_all, world=2, start_method="forkserver")


@pytest.mark.parametrize("case", ["parented", "external", "root_uses_child", "tied_stage1"])
@pytest.mark.parametrize("rank", [0, 1])
def test_modules_that_touch_others_work(features2: list[dict[str, Any]], case: str, rank: int) -> None:
    out = features2[rank][case]
    assert out["values_equal"]
    assert out["losses"] == out["ref_losses"]
    assert out["gathered_ok"]


def test_parameter_given_to_a_built_child_rebuilds_its_unit() -> None:
    model, zi, _ = _build(_Parented, _config("none", None, 1))
    # emb, child (weight, bias, gain: rebuilt as one), frozen, head
    assert zi.statistics().units == 4
    assert all(is_partitioned(p) for p in model.parameters())
    assert model.scale.untyped_storage().nbytes() == 16 * 4  # buffers stay whole
    assert torch.equal(model.scale, torch.full((16,), 0.5))


def test_placeholders_refuse_writes_and_gathered_writes_persist() -> None:
    cfg = _config("none", None, 1)
    model, _, _ = _build(Tiny, cfg)
    w = model.emb.weight
    assert w.shape == (VOCAB, 16) and w.dtype == torch.float32
    with pytest.raises(RuntimeError):
        torch.nn.init.normal_(w)  # a placeholder: one element, broadcast
    before = _values(model)["emb.weight"]
    with GatheredParameters(w, modifier_rank=0), torch.no_grad():
        w[0].fill_(3.0)
    with GatheredParameters(w), torch.no_grad():  # modifier_rank None: changes are discarded
        w[1].fill_(5.0)
    after = _values(model)["emb.weight"]
    assert torch.equal(after[0], torch.full((16,), 3.0))
    assert torch.equal(after[1:], before[1:])
    e = dstrain.initialize(model=model, config=cfg)[0]
    with GatheredParameters(e.module.emb.weight):
        assert torch.equal(e.module.emb.weight[0], torch.full((16,), 3.0))
    e.close()  # after initialize: tests/dstrain/zero/test_gathered_parameters.py


def test_enabled_false_builds_normally() -> None:
    with Init(config_dict_or_path=_config("none", None, 1), enabled=False):
        model = Tiny()
    assert not any(is_partitioned(p) for p in model.parameters())


# -- bad input ----------------------------------------------------------------------------------------


class _Ints(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.counts = nn.Parameter(torch.zeros(4, dtype=torch.int64), requires_grad=False)


def test_non_floating_parameter_is_refused_naming_the_module() -> None:
    with pytest.raises(InitError) as ei, Init(config_dict_or_path=_config("none", None, 1)):
        _Ints()
    assert "_Ints" in ei.value.module


_BUILT = 3


class _Breaks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(_BUILT))
        raise RuntimeError("construction failed halfway")


def test_failed_construction_frees_what_it_partitioned(tmp_path: Path) -> None:
    cfg = _config("nvme", str(tmp_path), 1)
    zi = Init(config_dict_or_path=cfg, remote_device="nvme")
    with pytest.raises(RuntimeError, match="halfway"), zi:
        _Breaks()
    st = zi.statistics()
    assert st.released and st.units == 0 and sum(st.shard_bytes.values()) == 0
    assert os.listdir(tmp_path) == []  # no swap file left
    zc = Init(config_dict_or_path=_config("cpu", None, 1), remote_device="cpu", pin_memory=True)
    with pytest.raises(RuntimeError, match="halfway"), zc:
        _Breaks()
    assert zc.statistics().units == 0 and sum(zc.statistics().shard_bytes.values()) == 0


def test_nvme_without_nvme_path_names_the_key() -> None:
    with pytest.raises(ConfigError) as ei:
        Init(config_dict_or_path=_config("none", None, 1), remote_device="nvme")
    assert ei.value.field == "zero_optimization.offload_param.nvme_path"


class _Big(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(256, 256)
        self.big = nn.Linear(2048, 2048)  # 16 MiB of fp32: more than the filesystem holds


@pytest.mark.needs_mount
def test_too_little_disk_is_a_typed_error_naming_bytes(tmp_path: Path) -> None:
    with mounted(tmp_path / "small", "tmpfs", "size=8m") as small:
        cfg = _config("nvme", str(small), 1)
        with pytest.raises(InsufficientDiskError) as ei, Init(config_dict_or_path=cfg, remote_device="nvme"):
            _Big()
        assert ei.value.needed > ei.value.free > 0
        assert str(ei.value.needed) in str(ei.value) and str(ei.value.free) in str(ei.value)
        assert os.listdir(small) == []


def test_inner_classes_defined_inside_the_block_are_partitioned() -> None:
    with Init(config_dict_or_path=_config("none", None, 1)):

        class Local(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.w = nn.Parameter(torch.randn(3, SEQ))

        m = Local()
    assert is_partitioned(m.w)
    assert "__init__" in Local.__dict__ and not is_partitioned(Local().w)  # unwrapped after the block


def test_adopted_units_give_their_disk_blocks_back(tmp_path: Path) -> None:
    from dstrain.dist.comm import Comm
    from dstrain.zero.init import adopt

    cfg = _config("nvme", str(tmp_path), 1)
    model, _, _ = _build(_Big, cfg, remote_device="nvme")
    (name,) = [f for f in os.listdir(tmp_path) if f.startswith("zero_init")]
    path = str(tmp_path / name)
    want = _values(model)["big.weight"]
    before = os.stat(path).st_blocks * 512
    params = list(model.big.parameters())
    shard = adopt(params, Comm(), torch.float32)
    assert shard is not None and torch.equal(shard.read()[: want.numel()], want.reshape(-1))
    shard.release()  # the engine placed it: Init's region of the file is punched out
    after = os.stat(path).st_blocks * 512
    assert before - after >= 2048 * 2048 * 4


@pytest.mark.parametrize("shard_dtype", [None, torch.float32])
def test_bf16_engine_adopts_shards_of_either_dtype(shard_dtype: torch.dtype | None) -> None:
    cfg = _config("none", None, 1)
    cfg["bf16"] = {"enabled": True}
    whole, _, _ = _build(Tiny, None)
    e = dstrain.initialize(model=whole, config=cfg)[0]
    ref = engine_losses(e, STEPS)
    e.close()
    model, zi, _ = _build(Tiny, cfg, dtype=shard_dtype)  # None: the config's dtype (bf16)
    assert zi.statistics().shard_bytes["device"] <= (2 if shard_dtype is None else 4) * 3000
    assert model.emb.weight.dtype == (torch.bfloat16 if shard_dtype is None else torch.float32)
    e = dstrain.initialize(model=model, config=cfg)[0]  # placeholders cast without materializing
    assert engine_losses(e, STEPS) == ref
    e.close()
