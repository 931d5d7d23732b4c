"""``zero_optimization.sub_group_size`` values that are not a multiple of 1024 (1e6, 5e6: common in
DeepSpeed configs) with parameters and optimizer state on NVMe: rounded up to the page-aligned size
the master file is stepped in, logged, and training runs as with that size given."""

from __future__ import annotations

import logging

import pytest
from _dstrain_helpers import engine_losses, make_model
from _offload_helpers import param_config

import dstrain
from dstrain.offload.optimizer.sub_groups import CUT


def _run(cfg: dict) -> tuple[list[float], int]:
    engine, optimizer, _, _ = dstrain.initialize(model=make_model(), config=cfg)
    try:
        return engine_losses(engine, 2), engine.config.zero_optimization.sub_group_size
    finally:
        engine.close()
        optimizer.close()


@pytest.mark.parametrize("given", [1e6, 5e6, 1000], ids=["1e6", "5e6", "1000"])
def test_sub_group_size_is_rounded_up_to_whole_pages(tmp_path, caplog, given: float) -> None:
    rounded = -(-int(given) // CUT) * CUT
    cfg = param_config(str(tmp_path), param="nvme", optimizer="nvme", sub_group=given)
    with caplog.at_level(logging.INFO, logger="dstrain.offload.compose"):
        losses, size = _run(cfg)
    assert size == rounded and size % CUT == 0
    assert any(f"rounded up to {rounded}" in r.getMessage() for r in caplog.records)
    want, _ = _run(param_config(str(tmp_path), param="nvme", optimizer="nvme", sub_group=rounded))
    assert losses == want  # the same training as with the rounded size given


def test_a_multiple_of_1024_is_kept(tmp_path, caplog) -> None:
    cfg = param_config(str(tmp_path), param="nvme", optimizer="nvme", sub_group=4 * CUT)
    with caplog.at_level(logging.INFO, logger="dstrain.offload.compose"):
        _, size = _run(cfg)
    assert size == 4 * CUT and not any("rounded up" in r.getMessage() for r in caplog.records)
