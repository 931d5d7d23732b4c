"""The comms_logger section (DeepSpeed's communication logging): per-kind counts, sizes, latency and
bandwidths, log_summary's table, the compressed 1-bit traffic in engine.statistics().comm and Prometheus,
and wall_clock_breakdown alongside."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from _dstrain_helpers import base_config, engine_losses, make_model, spawn

import dstrain
from dstrain.dist import comms_logger
from dstrain.dist.comms_logger import CommsLoggerConfig
from dstrain.errors import ConfigError


@pytest.fixture(autouse=True)
def _fresh() -> Any:
    comms_logger.reset()
    yield
    comms_logger.reset()


def test_section_keys_aliases_and_refusals() -> None:
    c = CommsLoggerConfig.from_dict(
        {
            "enabled": True,
            "verbose": False,
            "prof_all": False,
            "prof_ops": ["all_reduce", "all_gather_into_tensor"],
            "debug": False,
        }
    )
    assert c.prof_ops == ["all_reduce", "all_gather"]
    with pytest.raises(ConfigError) as e:
        CommsLoggerConfig.from_dict({"prof_ops": ["allreduce"]})
    assert e.value.field == "comms_logger.prof_ops"
    with pytest.raises(ConfigError) as e:
        CommsLoggerConfig.from_dict({"verbos": True})
    assert "verbose" in str(e.value)
    cfg = dstrain.DSConfig.load({"train_batch_size": 1, "comms_logger": {"enabled": False}})
    assert cfg.comms_logger is not None and not cfg.comms_logger.enabled


def test_bandwidths_follow_nccl_tests_definitions() -> None:
    log = comms_logger.configure({"enabled": True})
    assert log is not None
    log.record("all_reduce", 8_000_000, 0.004, 4)  # algbw 2 GB/s; ring: 2 (n-1)/n = 1.5
    log.record("all_reduce", 8_000_000, 0.004, 4)
    log.record("all_gather", 1_000_000, 0.001, 2)  # algbw 1 GB/s; (n-1)/n = 0.5
    log.record("broadcast", 1_000_000, 0.001, 2)  # busbw = algbw
    by = {(s.op, s.message_bytes): s for s in log.summary()}
    ar = by[("all_reduce", 8_000_000)]
    assert ar.count == 2 and ar.total_seconds == pytest.approx(0.008)
    assert ar.algbw_gbps == pytest.approx(2.0) and ar.busbw_gbps == pytest.approx(3.0)
    assert by[("all_gather", 1_000_000)].busbw_gbps == pytest.approx(0.5)
    assert by[("broadcast", 1_000_000)].busbw_gbps == pytest.approx(1.0)
    import dstrain.comm

    table = dstrain.comm.log_summary()  # deepspeed.comm.log_summary()'s place
    assert table.splitlines()[0].startswith("Comm. Op") and "Avg Latency(ms)" in table
    assert "all_reduce" in table and "7.6 MB" in table


def test_prof_ops_and_disabled_record_nothing_else() -> None:
    log = comms_logger.configure({"enabled": True, "prof_all": False, "prof_ops": ["all_gather"]})
    assert comms_logger.active("all_reduce") is None and comms_logger.active("all_gather") is log
    assert comms_logger.configure({"enabled": False}) is None
    assert comms_logger.active("all_gather") is None and comms_logger.log_summary() == ""


def _worker() -> dict[str, Any]:
    out: dict[str, Any] = {}
    # ZeRO-2 with the logger on (debug: keyed by caller) and the wall-clock breakdown logged
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())  # type: ignore[method-assign]
    logging.getLogger("dstrain").addHandler(handler)
    logging.getLogger("dstrain").setLevel(logging.INFO)
    cfg = base_config(2, world=2, comms_logger={"enabled": True, "verbose": True}, wall_clock_breakdown=True)
    cfg["steps_per_print"] = 1
    engine, _, _, _ = dstrain.initialize(model=make_model(), config=cfg)
    engine_losses(engine, 3)
    out["comm"] = engine.statistics().comm
    out["summary"] = comms_logger.active("all_reduce").summary()
    out["table"] = comms_logger.log_summary()
    out["records"] = records
    engine.close()
    comms_logger.reset()
    # 1-bit Adam: after the freeze only compressed traffic; counted in engine.statistics().comm
    opt = {"type": "OneBitAdam", "params": {"lr": 1e-2, "freeze_step": 2}}
    cfg = base_config(
        0,
        world=2,
        optimizer=opt,
        comms_logger={"enabled": True, "prof_all": False, "prof_ops": ["compressed_all_reduce"]},
    )
    engine, _, _, _ = dstrain.initialize(model=make_model(), config=cfg)
    engine_losses(engine, 6)
    out["onebit_comm"] = engine.statistics().comm
    out["onebit_stepper"] = engine.stepper.statistics().compressed
    out["onebit_summary"] = comms_logger.active("compressed_all_reduce").summary()
    from dstrain.metrics import samples

    out["samples"] = [(s.name, s.labels.get("op"), s.value) for s in samples(engine.statistics(), 0)]
    engine.close()
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return spawn(_worker, world=2, start_method="forkserver")


def test_every_collective_is_logged_with_size_and_latency(ranks: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(ranks):
        comm, summary = r["comm"], r["summary"]
        counts: dict[str, int] = {}
        sizes: dict[str, int] = {}
        for s in summary:
            counts[s.op] = counts.get(s.op, 0) + s.count
            sizes[s.op] = sizes.get(s.op, 0) + s.count * s.message_bytes
            assert s.total_seconds > 0 and s.algbw_gbps > 0
        for op in ("all_reduce", "reduce_scatter", "all_gather"):  # the logger saw what the counters counted
            assert counts.get(op, 0) == getattr(comm, f"{op}_calls")
            scale = 2 if op == "all_gather" else 1  # an all-gather moves its output: both ranks' chunks
            assert sizes.get(op, 0) == scale * getattr(comm, f"{op}_bytes")
        assert comm.all_reduce_calls > 0 and comm.all_gather_calls > 0
        assert counts["broadcast"] > 0  # initialize's weight broadcast
        assert "all_gather" in r["table"] and "broadcast" in r["table"]
        verbose = [m for m in r["records"] if m.startswith("comm op: ")]
        assert len(verbose) == sum(counts.values())
        wall = any(m.startswith("time: forward=") for m in r["records"])
        assert wall == (rank == 0)  # wall_clock_breakdown still logs (rank 0)


def test_compressed_traffic_in_engine_statistics_and_metrics(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        comm, st = r["onebit_comm"], r["onebit_stepper"]
        assert comm.compressed_calls == st.calls > 0
        assert comm.compressed_wire_bytes == st.wire_bytes > 0
        assert comm.compressed_fp32_bytes == st.fp32_allreduce_bytes
        assert comm.compressed_wire_bytes * 28 <= comm.compressed_fp32_bytes
        (line,) = r["onebit_summary"]  # prof_ops: only the compressed kind recorded
        assert line.op == "compressed_all_reduce" and line.count == st.calls
        got = {(name, op): v for name, op, v in r["samples"]}
        assert got[("dstrain_comm_bytes", "compressed_all_reduce")] == comm.compressed_wire_bytes
        assert got[("dstrain_comm_calls", "compressed_all_reduce")] == comm.compressed_calls
        assert got[("dstrain_comm_compressed_fp32_bytes", None)] == comm.compressed_fp32_bytes
