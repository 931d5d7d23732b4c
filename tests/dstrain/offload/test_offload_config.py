"""ZeRO-Infinity config: DeepSpeed's offload keys and defaults, strict parsing, refusals, nvme_path checks."""

from __future__ import annotations

import os
import stat
from typing import Any

import pytest
from _mount import mounted

from dstrain.config import DSConfig
from dstrain.errors import ConfigError, NotImplementedConfigError
from dstrain.offload.config import (
    DEFAULT_PINNED_BYTES,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    check_nvme_path,
    parse_offload,
)


def load(zero: dict[str, Any], **extra: Any) -> DSConfig:
    cfg = {"train_batch_size": 4, "zero_optimization": zero, **extra}
    return DSConfig.load(cfg)


def test_deepspeed_defaults() -> None:
    opt = parse_offload({"device": "cpu"}, "optimizer")
    assert isinstance(opt, OffloadOptimizerConfig)
    assert (opt.device, opt.nvme_path, opt.pin_memory, opt.buffer_count) == ("cpu", None, False, 4)
    assert (opt.pipeline_read, opt.pipeline_write, opt.fast_init, opt.ratio) == (False, False, False, 1.0)
    par = parse_offload({"device": "cpu"}, "param")
    assert isinstance(par, OffloadParamConfig)
    assert (par.buffer_count, par.buffer_size, par.max_in_cpu) == (5, 100_000_000, 1_000_000_000)
    for kind in ("optimizer", "param"):
        assert parse_offload(None, kind).device == "none"
        assert parse_offload({"device": None}, kind).device == "none"
    z = load({"stage": 3}).zero_optimization
    assert not z.offload_optimizer.enabled and not z.offload_param.enabled
    assert z.offload_pinned_bytes == DEFAULT_PINNED_BYTES


def test_typos_are_rejected_with_the_field_named() -> None:
    with pytest.raises(ConfigError) as e:
        load({"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memroy": True}})
    assert e.value.field == "zero_optimization.offload_optimizer.pin_memroy"
    with pytest.raises(ConfigError) as e:
        load({"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/tmp", "buffer_szie": 5}})
    assert e.value.field == "zero_optimization.offload_param.buffer_szie"
    with pytest.raises(ConfigError) as e:
        load({"stage": 2, "offload_optimizer": {"device": "disk"}})
    assert e.value.field == "zero_optimization.offload_optimizer.device"
    with pytest.raises(ConfigError) as e:
        load({"stage": 2, "offload_optimizer": {"device": "cpu", "buffer_count": 0}})
    assert e.value.field == "zero_optimization.offload_optimizer.buffer_count"
    with pytest.raises(ConfigError) as e:
        load({"stage": 2, "offload_optimizer": "cpu"})
    assert e.value.field == "zero_optimization.offload_optimizer"
    with pytest.raises(ConfigError) as e:
        load({"stage": 2, "offload_pinned_bytes": 1000})  # less than 1 MiB
    assert e.value.field == "zero_optimization.offload_pinned_bytes"


@pytest.mark.parametrize("key", ["step_in_backward", "step_thread"])
def test_dstrain_switches_default_on_and_take_only_booleans(key: str) -> None:
    """dstrain's own offload_optimizer keys: on unless asked, and a value that is not true/false
    (a JSON string, 0/1) is refused naming the key, not read as truthy."""
    assert getattr(parse_offload({"device": "cpu"}, "optimizer"), key) is True
    assert getattr(parse_offload({"device": "cpu", key: False}, "optimizer"), key) is False
    for bad in ("false", 0, None):
        with pytest.raises(ConfigError) as e:
            load({"stage": 3, "offload_optimizer": {"device": "cpu", key: bad}})
        assert e.value.field == f"zero_optimization.offload_optimizer.{key}"


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_optimizer_offload_at_stages_1_to_3_as_asked(stage: int, device: str, tmp_path) -> None:
    off: dict[str, Any] = {"device": device}
    if device == "nvme":
        off["nvme_path"] = str(tmp_path)
    z = load({"stage": stage, "offload_optimizer": off}).zero_optimization
    assert z.offload_optimizer.device == device  # nvme stays nvme at stages 1-2 (DeepSpeed: cpu)


def test_unsupported_combinations_are_refused(tmp_path) -> None:
    with pytest.raises(NotImplementedConfigError):
        load({"stage": 0, "offload_optimizer": {"device": "cpu"}})
    for stage in (0, 1, 2):
        with pytest.raises(ConfigError) as e:
            load({"stage": stage, "offload_param": {"device": "cpu"}})
        assert e.value.field == "zero_optimization.offload_param.device"
    with pytest.raises(ConfigError) as e:
        load({"stage": 3, "offload_optimizer": {"device": "nvme"}})  # no nvme_path
    assert e.value.field == "zero_optimization.offload_optimizer.nvme_path"
    for device in ("cpu", "nvme"):  # parameter offload is built at stage 3 (and parsed as asked)
        z = load({"stage": 3, "offload_param": {"device": device, "nvme_path": str(tmp_path)}})
        assert z.zero_optimization.offload_param.device == device
    with pytest.raises(NotImplementedConfigError) as e:
        load({"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}})
    assert e.value.field == "zero_optimization.offload_optimizer.ratio"


def test_nvme_path_checks(tmp_path) -> None:
    field = "zero_optimization.offload_optimizer.nvme_path"
    made = tmp_path / "missing" / "swap"
    check_nvme_path(field, str(made))  # created, as DeepSpeed does, and private to the user
    assert made.is_dir() and stat.S_IMODE(made.stat().st_mode) == 0o700
    made.rmdir()
    (tmp_path / "missing").rmdir()
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ConfigError):
        check_nvme_path(field, str(a_file))
    with pytest.raises(ConfigError) as e:  # cannot be created: a file is in the way
        check_nvme_path(field, str(a_file / "under"))
    assert e.value.field == field
    assert isinstance(check_nvme_path(field, str(tmp_path)), bool)
    assert os.listdir(tmp_path) == ["file"]  # the probe file is gone
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
        try:
            with pytest.raises(ConfigError):
                check_nvme_path(field, str(ro))
        finally:
            ro.chmod(stat.S_IRWXU)


@pytest.fixture
def no_odirect_fs(tmp_path):
    with mounted(tmp_path / "ramfs", "ramfs") as d:  # ramfs refuses O_DIRECT
        yield d


@pytest.mark.needs_mount
def test_nvme_path_on_a_filesystem_without_o_direct_is_a_logged_fallback(no_odirect_fs, caplog) -> None:
    with caplog.at_level("WARNING"):
        direct = check_nvme_path("zero_optimization.offload_optimizer.nvme_path", str(no_odirect_fs))
    assert direct is False
    assert "O_DIRECT" in caplog.text


@pytest.mark.needs_mount
def test_nvme_offload_runs_buffered_where_o_direct_is_refused(no_odirect_fs) -> None:
    import torch

    from dstrain.offload.optimizer.adam import OffloadAdam

    master = torch.randn(5000)
    master.requires_grad_(True)
    master.grad = torch.ones(5000)
    ref = master.detach().clone().requires_grad_(True)
    ref.grad = torch.ones(5000)
    off = OffloadAdam([master], device="nvme", nvme_path=str(no_odirect_fs), sub_group_size=2048)
    torch_opt = torch.optim.AdamW([ref], weight_decay=0.0, fused=True)
    for _ in range(3):
        off.step()
        torch_opt.step()
    st = off.statistics()
    off.close()
    assert st.swapper is not None and st.swapper.o_direct is False and st.swapper.reads >= 3 * st.sub_groups
    assert torch.equal(master.detach(), ref.detach())


def test_initialize_creates_a_missing_nvme_path(tmp_path) -> None:
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _dstrain_helpers import base_config, make_model

    import dstrain

    cfg = base_config(2, world=1)
    (tmp_path / "a-file").write_text("x")
    cfg["zero_optimization"]["offload_optimizer"] = {
        "device": "nvme",
        "nvme_path": str(tmp_path / "a-file" / "x"),
    }
    with pytest.raises(ConfigError) as e:
        dstrain.initialize(model=make_model(), config=cfg)
    assert e.value.field == "zero_optimization.offload_optimizer.nvme_path"
    cfg["zero_optimization"]["offload_optimizer"]["nvme_path"] = str(tmp_path / "new")
    engine, _, _, _ = dstrain.initialize(model=make_model(), config=cfg)
    engine.close()
    assert (tmp_path / "new").is_dir()
    cfg["zero_optimization"]["offload_optimizer"]["nvme_path"] = str(tmp_path)
    cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.1}}
    with pytest.raises(NotImplementedConfigError) as e:  # only Adam(W) state is offloaded
        dstrain.initialize(model=make_model(), config=cfg)
    assert e.value.field == "optimizer.type"
