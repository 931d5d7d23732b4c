"""``dstrain_offload_*`` series of offloading engines are each engine's own (labels ``rank``, ``engine``,
``kind``), exported as its ``dstrain_*`` series are: from ``dstrain.metrics.register(engine)`` until
``engine.close()``. Two live engines in one process never add into one series (dsio's collector sums
samples with equal labels), and closing one leaves the other's counters where they were."""

from __future__ import annotations

import gc
from typing import Any

import pytest
from _dstrain_helpers import engine_losses, make_model
from _offload_helpers import offload_config, param_config

import dstrain
from dstrain.metrics import labels, register
from dstrain.offload.metrics import own

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]  # (name, sorted labels) -> value


def _scrape(registry: Any) -> tuple[Series, set[str]]:
    """Every dstrain_ sample of one scrape parsed back from the exposition text (as Prometheus reads
    it), and the names of the counter samples; the same name and labels twice is an invalid scrape."""
    text = prometheus_client.generate_latest(registry).decode()
    out: Series = {}
    counters: set[str] = set()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if not s.name.startswith("dstrain_"):
                continue
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in out, f"duplicate series in one scrape: {key}"
            out[key] = s.value
            if fam.type == "counter":
                counters.add(s.name)
    return out, counters


def _offload_of(scrape: Series, engine: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The dstrain_offload_ samples labelled ``engine``, keyed by name and their other labels."""
    return {
        (name, tuple((k, v) for k, v in lab if k not in ("rank", "engine"))): value
        for (name, lab), value in scrape.items()
        if name.startswith("dstrain_offload_") and dict(lab).get("engine") == engine
    }


def _swap(of: dict[Any, float], kind: str, direction: str) -> float | None:
    return of.get(("dstrain_offload_swap_bytes_total", (("direction", direction), ("kind", kind))))


@pytest.fixture
def two_engines(tmp_path) -> Any:
    """A: stage 1, Adam's state on NVMe; B: stage 3, parameters and Adam's state on NVMe (kinds
    optimizer and param). Both registered in one registry, A by number, B as "critic"."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = dstrain.initialize(model=make_model(), config=offload_config(1, "nvme", str(tmp_path / "a")))[0]
    b = dstrain.initialize(
        model=make_model(1), config=param_config(str(tmp_path / "b"), param="nvme", optimizer="nvme")
    )[0]
    registry = prometheus_client.CollectorRegistry()
    try:
        register(a, registry)
        register(b, registry, name="critic")
        yield registry, a, b
    finally:
        a.close()
        b.close()


def _drained(engine: Any) -> Any:
    """``engine``'s offloaded optimizer statistics once the writes behind the last step are done."""
    engine.optimizer.swapped.swapper.drain()
    return engine.optimizer.statistics()


def test_two_live_offloading_engines_have_their_own_series(two_engines) -> None:
    registry, a, b = two_engines
    name_a = labels(a)["engine"]
    engine_losses(a, 2)
    engine_losses(b, 1)
    sa, sb = _drained(a), _drained(b)
    b.zero.store._swapper.drain()  # the parameter shards' last writes are behind too
    pb = b.zero.store.statistics()
    scrape, _ = _scrape(registry)  # (no duplicate name + labels)
    of_a, of_b = _offload_of(scrape, name_a), _offload_of(scrape, "critic")
    # each engine's own counts, not the sum of both (the optimizers swapped different amounts)
    assert sa.swapper.read_bytes != sb.swapper.read_bytes
    for direction, want_a, want_b in (
        ("read", sa.swapper.read_bytes, sb.swapper.read_bytes),
        ("write", sa.swapper.written_bytes, sb.swapper.written_bytes),
    ):
        assert _swap(of_a, "optimizer", direction) == want_a > 0
        assert _swap(of_b, "optimizer", direction) == want_b > 0
    assert _swap(of_b, "param", "read") == pb.swapper.read_bytes > 0
    assert _swap(of_a, "param", "read") is None  # A offloads no parameters
    step_seconds = ("dstrain_offload_step_seconds_total", (("kind", "optimizer"),))
    assert of_a[step_seconds] == sa.step_seconds and of_b[step_seconds] == sb.step_seconds
    # every dstrain_offload_ series is some engine's: none is left without the engine label
    assert all(
        dict(lab).get("engine") in (name_a, "critic")
        for (name, lab) in scrape
        if name.startswith("dstrain_offload_")
    )
    with pytest.raises(ValueError):
        own(a.optimizer, b)  # a part has one engine


def test_closing_one_engine_takes_its_series_and_leaves_the_others_counters(two_engines) -> None:
    registry, a, b = two_engines
    name_a = labels(a)["engine"]
    engine_losses(a, 1)
    engine_losses(b, 1)
    _drained(a)
    _drained(b)
    before, counters = _scrape(registry)
    assert _offload_of(before, "critic")
    b.close()
    after, _ = _scrape(registry)
    assert not [key for key in after if dict(key[1]).get("engine") == "critic"]  # B's series are gone
    mine = [key for key in before if dict(key[1]).get("engine") == name_a and key[0] in counters]
    assert any(name.startswith("dstrain_offload_") for name, _ in mine)
    for key in mine:  # a Prometheus counter goes down only at a reset: A's did not move
        assert after[key] >= before[key], key
    engine_losses(a, 1)  # and they go on counting
    st = _drained(a)
    again = _offload_of(_scrape(registry)[0], name_a)
    assert (
        _swap(again, "optimizer", "write")
        == st.swapper.written_bytes
        > _swap(_offload_of(after, name_a), "optimizer", "write")
    )


def test_an_engines_offload_series_follow_its_registration(tmp_path) -> None:
    from dsio import metrics

    registry = prometheus_client.CollectorRegistry()
    metrics.register(registry)
    gc.collect()  # offload parts built by hand in earlier tests are exported (engine=":N") until collected
    engine = dstrain.initialize(model=make_model(), config=offload_config(1, "nvme", str(tmp_path)))[0]
    try:
        engine_losses(engine, 1)
        scrape, _ = _scrape(registry)
        assert not [key for key in scrape if key[0].startswith("dstrain_offload_")]  # not registered yet
        register(engine, registry)  # now its series, dstrain_offload_ ones included, are exported
        name = labels(engine)["engine"]
        st = _drained(engine)
        assert (
            _swap(_offload_of(_scrape(registry)[0], name), "optimizer", "read") == st.swapper.read_bytes > 0
        )
    finally:
        engine.close()
    assert _offload_of(_scrape(registry)[0], name) == {}


def _hand_built(tmp_path: Any, n: int) -> Any:
    """An `OffloadAdam` used as a torch optimizer (no engine), state on NVMe, stepped once."""
    import torch

    from dstrain.offload.optimizer.adam import OffloadAdam

    tmp_path.mkdir()
    view = torch.zeros(n, requires_grad=True)
    view.grad = torch.ones(n)
    off = OffloadAdam([view], device="nvme", nvme_path=str(tmp_path), sub_group_size=4096, buffer_count=2)
    off.step()
    off.drain()
    return off


def test_hand_built_parts_of_one_kind_are_series_of_their_own(tmp_path) -> None:
    """Parts no engine owns, of one kind, never add into one series: each is labelled ``engine=":N"``
    (``N`` the smallest number no other open hand-built part of its kind holds; ``:`` is in no engine's
    name), so closing one leaves the other's counters where they were instead of dipping a sum."""
    from dsio import metrics

    gc.collect()  # hand-built parts an earlier test dropped unclosed are exported until collected
    registry = prometheus_client.CollectorRegistry()
    metrics.register(registry)
    first = _hand_built(tmp_path / "1", 9000)
    second = _hand_built(tmp_path / "2", 20000)
    try:
        scrape = _scrape(registry)[0]
        names = {dict(lab)["engine"] for name, lab in scrape if name.startswith("dstrain_offload_")}
        assert {":0", ":1"} <= names
        written = [s.swapper.written_bytes for s in (first.statistics(), second.statistics())]
        assert written[0] != written[1]
        assert [_swap(_offload_of(scrape, n), "optimizer", "write") for n in (":0", ":1")] == written
        first.close()
        after = _scrape(registry)[0]
        assert _offload_of(after, ":0") == {}  # gone whole with its part
        assert _swap(_offload_of(after, ":1"), "optimizer", "write") == written[1]  # not a dipped sum
        third = _hand_built(tmp_path / "3", 9000)  # takes the number the closed one freed
        try:
            third_written = third.statistics().swapper.written_bytes
            assert _swap(_offload_of(_scrape(registry)[0], ":0"), "optimizer", "write") == third_written
        finally:
            third.close()
    finally:
        first.close()
        second.close()
