"""``dstrain_`` Prometheus metrics come from the engine's statistics at scrape time.

Each engine's series are its own (labels ``rank`` and ``engine``): two live engines of one rank in one
process never add into one series nor clash; ``close()`` takes an engine's series out of the next
scrape, and an engine dropped without ``close()`` leaves once it is garbage-collected.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
from _dstrain_helpers import base_config, engine_losses, make_model

import dstrain
from dstrain.metrics import labels, register

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402


def _engine(lr: float = 1e-2) -> Any:
    cfg = base_config(3, world=1)
    cfg["optimizer"]["params"]["lr"] = lr
    return dstrain.initialize(model=make_model(), config=cfg)[0]


def _scrape(registry: Any) -> list[tuple[str, dict[str, str], float]]:
    """Every dstrain_ sample of one scrape, parsed back from the exposition text (as Prometheus reads
    it); a sample name with the same labels twice is an invalid scrape."""
    text = prometheus_client.generate_latest(registry).decode()
    out = [
        (s.name, dict(s.labels), s.value)
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name.startswith("dstrain_")
    ]
    keys = [(name, tuple(sorted(lab.items()))) for name, lab, _ in out]
    assert len(keys) == len(set(keys)), "duplicate series in one scrape"
    return out


def _of(scrape: list[tuple[str, dict[str, str], float]], engine: str) -> dict[str, float]:
    """``name{other labels}`` -> value of the samples labelled ``engine``."""
    return {
        name + str(sorted((k, v) for k, v in lab.items() if k not in ("rank", "engine"))): value
        for name, lab, value in scrape
        if lab.get("engine") == engine
    }


@pytest.mark.parametrize("earlier", [False, True], ids=["alone", "beside-an-earlier-live-engine"])
def test_metrics_follow_training(earlier: bool) -> None:
    registry = prometheus_client.CollectorRegistry()
    other = None
    if earlier:  # an engine of an earlier test still alive (and registered) in this process
        other = _engine()
        register(other, registry)
        engine_losses(other, 3)
    engine = _engine()
    register(engine, registry)
    mine = labels(engine)
    assert mine["rank"] == "0"
    assert registry.get_sample_value("dstrain_steps_total", mine) == 0
    engine_losses(engine, 3)
    assert registry.get_sample_value("dstrain_steps_total", mine) == 3
    assert registry.get_sample_value("dstrain_micro_steps_total", mine) == 3
    assert registry.get_sample_value("dstrain_phase_seconds_total", {**mine, "phase": "forward"}) > 0
    assert (
        registry.get_sample_value("dstrain_resident_param_elements", mine)
        == engine.statistics().zero.resident_param_numel
    )
    text = prometheus_client.generate_latest(registry).decode()
    assert "dstrain_comm_bytes_total" in text and "dstrain_loss_scale" in text
    if other is not None:
        assert registry.get_sample_value("dstrain_steps_total", labels(other)) == 3
        other.close()
    engine.close()


def test_two_live_engines_of_one_rank_have_their_own_series() -> None:
    registry = prometheus_client.CollectorRegistry()
    a, b = _engine(lr=1e-2), _engine(lr=3e-3)
    try:
        register(a, registry)
        register(b, registry, name="critic")
        assert labels(b) == {"rank": "0", "engine": "critic"}
        name_a = labels(a)["engine"]
        assert name_a != "critic"
        register(a, registry)  # again: the same name
        assert labels(a)["engine"] == name_a
        with pytest.raises(ValueError):
            register(a, registry, name="other")  # an engine has one name
        c = _engine()
        with pytest.raises(ValueError):
            register(c, registry, name="critic")  # held by b, open
        c.close()
        engine_losses(a, 2)
        engine_losses(b, 1)
        scrape = _scrape(registry)
        of_a, of_b = _of(scrape, name_a), _of(scrape, "critic")
        assert of_a["dstrain_steps_total[]"] == 2 and of_b["dstrain_steps_total[]"] == 1
        assert of_a["dstrain_lr[('group', '0')]"] == 1e-2 and of_b["dstrain_lr[('group', '0')]"] == 3e-3
        assert of_a["dstrain_loss[]"] == pytest.approx(a.statistics().last_loss, rel=1e-6)
        assert of_b["dstrain_loss[]"] == pytest.approx(b.statistics().last_loss, rel=1e-6)
        assert of_a.keys() == of_b.keys()  # the same families, each engine's own values
        assert len(of_a) > 20
    finally:
        a.close()
        b.close()


def _exported_after_one_step() -> tuple[Any, Any, str]:
    """A registry, a registered engine that trained one step (seen in a scrape), its name."""
    registry = prometheus_client.CollectorRegistry()
    engine = _engine()
    register(engine, registry)
    name = labels(engine)["engine"]
    engine_losses(engine, 1)
    assert _of(_scrape(registry), name)["dstrain_steps_total[]"] == 1
    return registry, engine, name


def test_close_takes_the_engines_series_out_of_the_next_scrape() -> None:
    registry, engine, name = _exported_after_one_step()
    engine.close()
    assert _of(_scrape(registry), name) == {}  # while the engine object is still alive
    with pytest.raises(KeyError):
        labels(engine)
    with pytest.raises(ValueError):
        register(engine, registry)  # a closed engine exports nothing
    again = _engine()
    register(again, registry, name=name)  # its name is free again
    assert _of(_scrape(registry), name)["dstrain_steps_total[]"] == 0
    again.close()


def test_an_engine_dropped_without_close_leaves_when_collected() -> None:
    registry, engine, name = _exported_after_one_step()
    del engine
    gc.collect()
    assert _of(_scrape(registry), name) == {}
    again = _engine()
    register(again, registry, name=name)  # a collected engine holds no name
    again.close()
