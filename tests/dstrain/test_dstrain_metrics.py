"""``dstrain_`` Prometheus metrics come from the engine's statistics at scrape time."""

from __future__ import annotations

import pytest
from _dstrain_helpers import base_config, engine_losses, make_model

import dstrain
from dstrain.metrics import register

prometheus_client = pytest.importorskip("prometheus_client")


def test_metrics_follow_training() -> None:
    engine, _, _, _ = dstrain.initialize(model=make_model(), config=base_config(3, world=1))
    registry = prometheus_client.CollectorRegistry()
    register(engine, registry)
    assert registry.get_sample_value("dstrain_steps_total", {"rank": "0"}) == 0
    engine_losses(engine, 3)
    assert registry.get_sample_value("dstrain_steps_total", {"rank": "0"}) == 3
    assert registry.get_sample_value("dstrain_micro_steps_total", {"rank": "0"}) == 3
    assert registry.get_sample_value("dstrain_phase_seconds_total", {"rank": "0", "phase": "forward"}) > 0
    assert (
        registry.get_sample_value("dstrain_resident_param_elements", {"rank": "0"})
        == engine.statistics().zero.resident_param_numel
    )
    text = prometheus_client.generate_latest(registry).decode()
    assert "dstrain_comm_bytes_total" in text and "dstrain_loss_scale" in text
    engine.close()
