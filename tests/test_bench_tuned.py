"""bench/io.py's tuned-vs-tuned sweep and its asyncio-vs-uvloop rows (issue 16).

The sweep must contain each side's default configuration (so "tuned" is never below "default"
measured the same way), every point must reach the handle it measures with its own settings,
and the report must name the winner and show the default point beside the main table's run.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dsio  # noqa: E402
from bench import io as bench_io  # noqa: E402

MIB = 1 << 20


def test_the_sweep_contains_both_sides_defaults():
    d = dsio.IOConfig()
    assert (d.intra_op_parallelism, d.overlap_events, d.block_size, d.queue_depth) in bench_io.SWEEP
    assert bench_io.DEEPSPEED_DEFAULT == (1, False, MIB, 128)  # aio_handle's defaults
    assert bench_io.DEEPSPEED_DEFAULT in bench_io.SWEEP
    assert len(set(bench_io.SWEEP)) == len(bench_io.SWEEP)


def test_each_point_measures_a_handle_with_its_own_settings(tmp_path, monkeypatch):
    """A point that never applied its settings would measure the same handle every time."""
    seen: list[tuple[int, bool, int, int]] = []
    real = dsio.AsyncIOHandle

    def handle(cfg: dsio.IOConfig) -> dsio.AsyncIOHandle:
        seen.append((cfg.intra_op_parallelism, cfg.overlap_events, cfg.block_size, cfg.queue_depth))
        return real(cfg)

    monkeypatch.setattr(bench_io.dsio, "AsyncIOHandle", handle)
    sweep = [bench_io.DSIO_DEFAULT, (1, False, MIB, 32)]
    data = bench_io.run_tuned(str(tmp_path), 4 * MIB, 2, None, "", sweep=sweep)
    # Reps outside, points inside, the starting point rotating: no point always runs last.
    assert seen == sweep + sweep[::-1]
    dsio_res = data["results"]["dsio"]
    for op in ("write", "read"):
        assert set(dsio_res[op]) == {bench_io.label(*p) for p in sweep}
        assert all(len(v) == 2 and all(x > 0 for x in v) for v in dsio_res[op].values())
    assert data["defaults"]["dsio"] == bench_io.label(*bench_io.DSIO_DEFAULT)
    assert not os.path.exists(tmp_path / "tuned.bin")


def test_reference_runs_next_to_the_default_point_on_the_callers_buffer(tmp_path, monkeypatch):
    """bench/io.py's main-table method is measured in the same minutes as the sweep's default point,
    and the sweep writes from the caller's buffer (no second locked buffer)."""
    import torch

    from dsio._native import native

    size = 4 * MIB
    buf = torch.frombuffer(native().AlignedBuffer(size, True), dtype=torch.uint8)
    buf.fill_(9)
    events: list[str] = []
    real = dsio.AsyncIOHandle

    class Spy(real):  # type: ignore[misc,valid-type]
        async def pwrite(self, tensor, path, offset=None, *, fsync=False):  # noqa: ANN001
            assert tensor.data_ptr() == buf.data_ptr()
            c = self.config
            events.append(f"point {c.intra_op_parallelism},{c.queue_depth}")
            return await super().pwrite(tensor, path, offset, fsync=fsync)

    monkeypatch.setattr(bench_io.dsio, "AsyncIOHandle", Spy)

    def reference() -> tuple[float, float]:
        events.append("reference")
        return 1.0, 2.0

    other = (1, False, MIB, 32)
    data = bench_io.run_tuned(
        str(tmp_path), size, 3, None, "", sweep=[bench_io.DSIO_DEFAULT, other], buf=buf, reference=reference
    )
    d = f"point {bench_io.DSIO_DEFAULT[0]},{bench_io.DSIO_DEFAULT[3]}"
    assert events.count("reference") == 3
    for i, e in enumerate(events):
        if e == "reference":  # always adjacent to the default point
            assert d in events[max(i - 1, 0) : i + 2]
    assert data["reference"] == {"write": [1.0, 1.0, 1.0], "read": [2.0, 2.0, 2.0]}
    assert (buf == 9).all()  # read back what it wrote
    md = bench_io.report_tuned(data, size)
    assert "main-table method 1.00 (1.00-1.00) GB/s" in md
    with pytest.raises(ValueError):
        bench_io.run_tuned(str(tmp_path), size + MIB, 1, None, "", sweep=[other], buf=buf)


def test_report_names_the_best_point_and_shows_the_default_beside_the_main_run():
    default = bench_io.label(*bench_io.DSIO_DEFAULT)
    other = bench_io.label(1, False, MIB, 32)
    data = {
        "results": {
            "dsio": {
                "write": {default: [2.1, 2.2, 2.0], other: [1.8, 1.9, 1.7]},
                "read": {default: [1.5], other: [1.9]},
            },
            "DeepSpeed": {
                "write": {bench_io.label(*bench_io.DEEPSPEED_DEFAULT): [2.0]},
                "read": {bench_io.label(*bench_io.DEEPSPEED_DEFAULT): [1.9]},
            },
        },
        "cold": False,
    }
    md = bench_io.report_tuned(data, 1 << 30, {("dsio", "write"): 2.12})
    rows = {
        tuple(c.strip() for c in line.split("|")[1:3]): line
        for line in md.splitlines()
        if line.startswith("| ")
    }
    assert default in rows["dsio", "write"] and "2.10 (2.00-2.20)" in rows["dsio", "write"]
    assert rows["dsio", "write"].rstrip(" |").endswith("2.12")
    assert other in rows["dsio", "read"]  # the best point wins, not the default
    assert "tuned dsio / tuned DeepSpeed, write: 1.05x" in md and "WARM" in md


@pytest.mark.parametrize("have_uvloop", [True, False])
def test_asyncio_vs_uvloop_rows(have_uvloop):
    res = {
        "dsio io_uring (default config)": {"ops_write_64K_path": [1000.0, 1200.0], "ops_read_64K": [500.0]},
    }
    if have_uvloop:
        res[bench_io.UVLOOP] = {"ops_write_64K_path": [1500.0, 1700.0], "ops_read_64K": [400.0]}
    lines = bench_io.loop_lines(res)
    if not have_uvloop:
        assert lines == []
        return
    text = "\n".join(lines)
    assert "| 64K write, path per op | 1,100 (1,000-1,200) | 1,600 (1,500-1,700) | 1.45x |" in text
    assert "| 64K read, one open file | 500 (500-500) | 400 (400-400) | 0.80x |" in text
