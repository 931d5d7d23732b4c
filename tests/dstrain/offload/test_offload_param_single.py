"""Parameter offload in one process (world size 1): refusals with the field named, metrics, and engine
checkpoints of a param-offloaded run that resume bit-for-bit in any offload setting."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from _dstrain_helpers import engine_losses, make_model
from _offload_helpers import final_params, param_config

import dstrain
from dstrain.errors import ConfigError


def _close(engine: Any, optimizer: Any) -> None:
    engine.close()
    if hasattr(optimizer, "close"):
        optimizer.close()


def test_missing_nvme_path_is_created_private(tmp_path) -> None:
    # DeepSpeed creates a missing nvme_path; dstrain does too, private to the user (0700)
    path = tmp_path / "missing"
    engine, optimizer, _, _ = dstrain.initialize(
        model=make_model(), config=param_config(str(path), param="nvme")
    )
    try:
        assert path.is_dir()
        assert path.stat().st_mode & 0o777 == 0o700
    finally:
        _close(engine, optimizer)


def test_nvme_path_that_cannot_be_created_is_refused_at_initialize(tmp_path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"x")  # a path under a regular file can never be a directory
    cfg = param_config(str(blocker / "swap"), param="nvme")
    with pytest.raises(ConfigError) as e:
        dstrain.initialize(model=make_model(), config=cfg)
    assert e.value.field == "zero_optimization.offload_param.nvme_path"


def test_budget_below_one_shard_buffer_is_named(tmp_path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 4))  # 4 MiB unit
    cfg = param_config(str(tmp_path), param="nvme", budget=2 << 20)
    with pytest.raises(ConfigError) as e:
        dstrain.initialize(model=model, config=cfg)
    assert e.value.field == "zero_optimization.offload_pinned_bytes"


def test_param_metrics_on_dsio_exporter(tmp_path) -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    from dsio import metrics
    from dstrain.metrics import labels as engine_labels
    from dstrain.metrics import register

    registry = prometheus_client.CollectorRegistry()
    metrics.register(registry)
    engine, opt, _, _ = dstrain.initialize(
        model=make_model(), config=param_config(str(tmp_path), param="nvme", optimizer="nvme")
    )
    register(engine, registry)  # the engine's series, its offload parts' among them
    store = engine.zero.store
    mine = engine_labels(engine)  # rank, engine
    labels = {**mine, "kind": "param"}

    def value(name: str, **extra: str) -> float:
        return registry.get_sample_value(name, {**labels, **extra}) or 0.0

    def swap(direction: str) -> float:
        return value("dstrain_offload_swap_bytes_total", direction=direction)

    engine_losses(engine, 3)
    store._swapper.drain()  # the last writes are behind
    st = store.statistics()
    # the engine's own series: exactly its store's counts (no other engine's added in)
    assert swap("read") == st.swapper.read_bytes > 0
    assert swap("write") == st.swapper.written_bytes > 0
    assert value("dstrain_offload_prefetch_total", result="hit") == st.prefetch_hits > 0
    assert value("dstrain_offload_stall_seconds_total") == st.stall_seconds
    assert value("dstrain_offload_pinned_bytes") == st.pinned_bytes <= st.pinned_budget
    # the optimizer's own series stay apart (kind="optimizer")
    assert registry.get_sample_value(
        "dstrain_offload_swap_bytes_total", {**mine, "kind": "optimizer", "direction": "read"}
    )
    _close(engine, opt)
    assert registry.get_sample_value("dstrain_offload_pinned_bytes", labels) is None  # gone with the store


@pytest.mark.parametrize(
    ("save", "load"),
    [
        (("nvme", "nvme"), ("nvme", "nvme")),
        (("nvme", "nvme"), ("none", "none")),
        (("cpu", "none"), ("nvme", "cpu")),
    ],
)
def test_checkpoint_resumes_bitwise_across_settings(
    tmp_path, save: tuple[str, str], load: tuple[str, str]
) -> None:
    """(param, optimizer) devices when saving and when loading; the resumed run equals an
    uninterrupted run without offload, losses and weights bitwise."""
    steps = 3
    root = str(tmp_path)
    ckpt = os.path.join(root, "ckpt")
    engine, opt = dstrain.initialize(
        model=make_model(), config=param_config(root, param=save[0], optimizer=save[1])
    )[:2]
    engine_losses(engine, steps)
    engine.save_checkpoint(ckpt)
    _close(engine, opt)
    engine, opt = dstrain.initialize(
        model=make_model(seed=7), config=param_config(root, param=load[0], optimizer=load[1])
    )[:2]
    engine.load_checkpoint(ckpt)
    resumed = engine_losses(engine, steps, start=steps)
    params = final_params(engine)
    _close(engine, opt)
    engine, opt = dstrain.initialize(model=make_model(), config=param_config(root))[:2]
    whole = engine_losses(engine, 2 * steps)
    ref = final_params(engine)
    _close(engine, opt)
    assert resumed == whole[steps:]
    for a, b in zip(params, ref, strict=True):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_params_with_shards_on_host_and_nvme_match_no_offload(tmp_path) -> None:
    """On a GPU the gathered parameters and the master stay on the device; shards live in host memory
    (``cpu``) or the NVMe file and are copied host <-> device at each gather and after each step."""
    out = {}
    for param in ("none", "cpu", "nvme"):
        engine, opt = dstrain.initialize(
            model=make_model().cuda(), config=param_config(str(tmp_path), param=param)
        )[:2]
        assert next(engine.module.parameters()).is_cuda
        out[param] = (engine_losses(engine, 4), [t.cpu() for t in final_params(engine)])
        _close(engine, opt)
    for param in ("cpu", "nvme"):
        assert out[param][0] == out["none"][0]
        for a, b in zip(out[param][1], out["none"][1], strict=True):
            assert torch.equal(a, b)
