"""The ``dsio`` command line: report, tune, bench; argparse-quality errors, no tracebacks."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys

import pytest

import dsio
from dsio.cli import AIO_KEYS, main, parse_size

# A small sweep that still exercises every rung and early stopping (8 points x 2 ops).
SMALL_TUNE = [
    "--size",
    "16M",
    "--block-sizes",
    "256K,1M",
    "--queue-depths",
    "4,32",
    "--parallelism",
    "1",
    "--reps",
    "2",
    "--finalists",
    "2",
    "--quiet",
]


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dsio.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def test_parse_size():
    assert parse_size("4096") == 4096
    assert parse_size("64K") == 64 << 10
    assert parse_size("64KiB") == 64 << 10
    assert parse_size("512m") == 512 << 20
    assert parse_size("1G") == 1 << 30
    assert parse_size("1GB") == 1 << 30
    for bad in ("", "G", "1.5G", "-1G", "1X", "ten"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_report_says_why(data_dir, capsys):
    missing = os.path.join(data_dir, "missing")
    assert main(["report", "--dir", data_dir, "--dir", missing]) == 0
    out = capsys.readouterr().out
    assert "dsio report" in out and dsio.__version__ in out
    for b in dsio.backend_status():
        line = next(ln for ln in out.splitlines() if ln.strip().startswith(b.name + " "))
        assert ("available" in line) if b.available else (b.reason in line)
    assert "O_DIRECT   works" in out or "O_DIRECT   unavailable" in out
    assert "does not exist" in out
    assert "CUDA" in out and "libcufile" in out
    assert os.uname().release in out


def test_report_json(data_dir, capsys):
    assert main(["report", "--json", "--dir", data_dir]) == 0
    info = json.loads(capsys.readouterr().out)
    assert {b["name"] for b in info["backends"]} == {"io_uring", "aio", "posix"}
    assert all(b["available"] or b["reason"] for b in info["backends"])
    (d,) = info["directories"]
    try:  # what the kernel says, independently of dsio
        os.close(os.open(os.path.join(data_dir, "probe"), os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600))
        direct = True
    except OSError:
        direct = False
    os.unlink(os.path.join(data_dir, "probe"))
    assert d["o_direct"] is direct
    if direct:
        assert d["dio_alignment"] in (512, 1024, 2048, 4096)
    assert d["filesystem"] not in ("", "?") and os.path.realpath(data_dir).startswith(d["mount"])
    if d["device"] != "no block device":
        assert d["logical_block_size"] in (512, 1024, 2048, 4096)
    assert not os.listdir(data_dir), "report must clean up its probe file"
    assert info["cuda"]["available"] in (True, False)
    assert "reason" in info["cuda"] or info["cuda"]["available"]
    from dsio.checkpoint._integrity import crc_path, crc_paths

    assert info["crc32c"]["path"] == crc_path()  # the path this process's checkpoints checksum with
    assert info["crc32c"]["available"] == sorted(crc_paths())


def test_report_honours_disabled_backends(data_dir, monkeypatch, capsys):
    # In process: the variable is read on every probe (the console entry point has its own test).
    monkeypatch.setenv("DSIO_DISABLE_BACKENDS", "io_uring")
    assert main(["report", "--dir", data_dir]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("io_uring"))
    assert "disabled by DSIO_DISABLE_BACKENDS" in line
    assert "auto ->   aio" in out


def test_report_lists_what_dstrain_can_do_here(data_dir, monkeypatch, capsys):
    """As ds_report lists DeepSpeed's ops: offload devices, gloo/NCCL, CUDA, cuFile, integrations."""
    from importlib import metadata

    import torch.distributed as dist

    from dsio._report import INTEGRATIONS

    assert main(["report", "--json", "--dir", data_dir]) == 0
    info = json.loads(capsys.readouterr().out)
    t = info["dstrain"]
    assert t["installed"] is True
    assert t["offload_devices"]["cpu"] == "available"
    direct = info["directories"][0]["o_direct"]
    assert (
        t["offload_devices"]["nvme"].startswith("available")
        and ("O_DIRECT in" in t["offload_devices"]["nvme"]) is direct
    )
    assert (t["process_groups"]["gloo"] == "available") is dist.is_gloo_available()
    nccl_ok = dist.is_nccl_available() and info["cuda"]["available"]
    assert (t["process_groups"]["nccl"] == "available") is nccl_ok
    assert (
        t["cuda"].startswith("available") is info["cuda"]["available"]
        and t["cufile"] == info["cuda"]["cufile"]
    )
    assert set(t["integrations"]) == set(INTEGRATIONS)
    for name, x in t["integrations"].items():
        try:
            want = metadata.version(name)
        except metadata.PackageNotFoundError:
            want = None
        assert x["version"] == want, name
    assert main(["report", "--dir", data_dir]) == 0
    text = capsys.readouterr().out
    assert "  dstrain    installed" in text and "    offload    cpu available; nvme" in text
    assert "    dist       gloo" in text and "uvloop" in text
    monkeypatch.setenv("DSIO_DISABLE_BACKENDS", "io_uring,aio,posix")
    assert main(["report", "--json", "--dir", data_dir]) == 0
    assert json.loads(capsys.readouterr().out)["dstrain"]["offload_devices"]["nvme"].startswith("unavailable")


def test_tune_writes_dstrain_aio_block_csv_and_png(data_dir, tmp_path, capsys):
    out = tmp_path / "res" / "tune"
    out.parent.mkdir()
    assert main(["tune", "--dir", data_dir, "--out", str(out), *SMALL_TUNE]) == 0
    text = capsys.readouterr().out
    assert "best write" in text and "best read" in text
    doc = json.loads((tmp_path / "res" / "tune.json").read_text())
    assert list(doc) == ["aio"]
    assert tuple(doc["aio"]) == (*AIO_KEYS, "backend")  # the tuned backend is part of the block
    # dstrain's config accepts it as is (DeepSpeed's own tuner emits a key its config rejects).
    from dstrain.config import DSConfig

    cfg = DSConfig.load({"train_batch_size": 1, **doc})
    assert cfg.aio.block_size == doc["aio"]["block_size"]
    assert cfg.aio.queue_depth == doc["aio"]["queue_depth"]
    assert cfg.aio.backend == doc["aio"]["backend"] in [b.name for b in dsio.backend_status() if b.available]
    dsio.IOConfig(**doc["aio"])  # and dsio's
    rows = list(csv.DictReader((tmp_path / "res" / "tune.csv").read_text().splitlines()))
    backends = [b.name for b in dsio.backend_status() if b.available]
    n_points = 2 * 2 * 1 * 3 * len(backends)
    screening = [r for r in rows if r["rung"] == "1"]
    assert len(screening) == 2 * n_points  # every point, read and write
    assert any(r["status"].startswith("early-stopped") for r in rows)
    final = [r for r in rows if r["status"] == "final"]
    assert final and all(r["reps"] == "2" and int(r["bytes"]) == 16 << 20 for r in final)
    assert {r["op"] for r in final} == {"read", "write"}
    for r in rows:
        assert float(r["gbps_min"]) <= float(r["gbps_median"]) <= float(r["gbps_max"])
        assert float(r["gbps_median"]) > 0
    png = (tmp_path / "res" / "tune.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [f for f in os.listdir(data_dir) if f.startswith(".dsio")], "tune must remove its scratch file"


def test_tune_optimize_read_picks_the_best_read_and_names_its_backend(data_dir, tmp_path):
    out = tmp_path / "r"
    assert main(["tune", "--dir", data_dir, "--out", str(out), "--optimize", "read", *SMALL_TUNE]) == 0
    rows = list(csv.DictReader(out.with_suffix(".csv").read_text().splitlines()))
    final = [r for r in rows if r["status"] == "final" and r["op"] == "read"]
    best = max(final, key=lambda r: float(r["gbps_median"]))
    aio = json.loads(out.with_suffix(".json").read_text())["aio"]
    assert aio["backend"] == best["backend"]
    assert aio["block_size"] == int(best["block_size"])
    assert aio["queue_depth"] == int(best["queue_depth"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["tune"], "the following arguments are required: --dir"),
        (["tune", "--dir", ".", "--size", "1X"], "not a size"),
        (["tune", "--dir", ".", "--size", "1000"], "multiple of 4096"),
        (["tune", "--dir", ".", "--block-sizes", "12K"], "power of two"),
        (["tune", "--dir", ".", "--queue-depths", "0"], "must be >= 1"),
        (["tune", "--dir", ".", "--backends", "spdk"], "unknown backend"),
        (["tune", "--dir", ".", "--optimize", "fast"], "invalid choice"),
        (["bench", "--dir", ".", "--op-size", "abc"], "not a size"),
        (["frobnicate"], "invalid choice"),
        ([], "required"),
    ],
)
def test_bad_arguments_get_argparse_errors(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage: dsio" in err and message in err
    assert "Traceback" not in err


def test_unusable_directories_get_a_clear_message(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    cases = [
        (str(tmp_path / "missing"), "does not exist"),
        (str(f), "is not a directory"),
        ("/proc/self", "cannot write to /proc/self"),  # not writable even by root
    ]
    for d, message in cases:
        for cmd in (["tune", "--dir", d, "--quiet", "--out", str(tmp_path / "t")], ["bench", "--dir", d]):
            assert main(cmd) == 1
            err = capsys.readouterr().err
            assert f"dsio {cmd[0]}: error:" in err and message in err, err
            assert "Traceback" not in err


def test_unwritable_output_prefix(data_dir, tmp_path, capsys):
    assert main(["tune", "--dir", data_dir, "--out", str(tmp_path / "nope" / "x"), "--quiet"]) == 1
    assert "cannot write results" in capsys.readouterr().err


def test_tune_gpu_without_cuda_says_so(data_dir, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the no-CUDA message cannot be exercised")
    assert main(["tune", "--dir", data_dir, "--gpu", "--quiet"]) == 1
    assert "needs a CUDA device" in capsys.readouterr().err


def test_tune_unavailable_backend_is_an_error(data_dir, monkeypatch, capsys):
    monkeypatch.setenv("DSIO_DISABLE_BACKENDS", "aio")
    assert main(["tune", "--dir", data_dir, "--backends", "aio", "--quiet"]) == 1  # no exception escapes
    err = capsys.readouterr().err
    assert "backend aio is unavailable here: disabled by DSIO_DISABLE_BACKENDS" in err
    assert "Traceback" not in err


def test_bench_json(data_dir, capsys):
    args = ["bench", "--dir", data_dir, "--size", "8M", "--ops", "200", "--reps", "2", "--json"]
    assert main([*args, "--queue-depth", "16", "--no-overlap-events"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["config"]["queue_depth"] == 16 and res["config"]["overlap_events"] is False
    for key in ("write_new_gbps", "write_overwrite_gbps", "read_gbps", "write_ops_per_s", "read_ops_per_s"):
        s = res[key]
        assert 0 < s["min"] <= s["median"] <= s["max"], key
    assert not [f for f in os.listdir(data_dir) if f.startswith(".dsio")]


def test_bench_with_tuned_config_and_table(data_dir, tmp_path, capsys):
    conf = tmp_path / "ds.json"
    conf.write_text(json.dumps({"train_batch_size": 8, "aio": {"block_size": 262144, "thread_count": 2}}))
    assert (
        main(
            ["bench", "--dir", data_dir, "--size", "4M", "--ops", "100", "--reps", "1", "--config", str(conf)]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "block_size=262144" in out and "intra_op_parallelism=2" in out
    for label in ("write, new file", "write, overwrite", "read", "64 KiB writes", "64 KiB reads"):
        assert label in out


def test_bench_bad_config(data_dir, tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"aio": {"block_size": 1048576, "buffer_count": 4}}))
    assert main(["bench", "--dir", data_dir, "--config", str(bad)]) == 1
    assert "'buffer_count'" in capsys.readouterr().err  # the unknown key is named
    bad.write_text(json.dumps({"aio": {"block_size": 3000}}))
    assert main(["bench", "--dir", data_dir, "--config", str(bad)]) == 1
    assert "block_size" in capsys.readouterr().err
    bad.write_text("{not json")
    assert main(["bench", "--dir", data_dir, "--config", str(bad)]) == 1
    assert "is not JSON" in capsys.readouterr().err
    assert main(["bench", "--dir", data_dir, "--config", str(tmp_path / "none.json")]) == 1
    assert "cannot read --config" in capsys.readouterr().err


def test_console_entry_point(data_dir):
    """`python -m dsio.cli` and the installed `dsio` script (pyproject: dsio = dsio.cli:main)."""
    r = _run("report", "--dir", data_dir)
    assert r.returncode == 0 and "dsio report" in r.stdout, r.stderr
    script = os.path.join(os.path.dirname(sys.executable), "dsio")
    if os.path.exists(script):
        r = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "report" in r.stdout and "tune" in r.stdout


def test_io_failure_mid_run_is_one_line(data_dir, monkeypatch, capsys):
    """An I/O error in the middle of a sweep (here: injected ENOSPC) is a message, not a traceback."""
    import errno

    from dsio import _tune

    async def boom(*_a, **_k):
        raise dsio.IOFailedError(errno.ENOSPC, "/x", 0)

    monkeypatch.setattr(_tune, "_timed", boom)
    assert main(["tune", "--dir", data_dir, "--out", os.path.join(data_dir, "t"), *SMALL_TUNE]) == 1
    err = capsys.readouterr().err
    assert "dsio tune: error: IOFailedError" in err and "No space left" in err
    assert not [f for f in os.listdir(data_dir) if f.startswith(".dsio")], "scratch file left behind"


def test_successive_halving_with_known_speeds(data_dir, tmp_path, monkeypatch, capsys):
    """Fake timings (aio 3 GB/s > posix 2 > io_uring 1; bigger blocks a little faster): early
    stopping drops the slow points, aio wins overall, and the backend "auto" picks still reaches
    the aio block names the backend it was tuned for (the overall winner), so it runs on that one."""
    from dsio import _tune

    avail = [b.name for b in dsio.backend_status() if b.available]
    if avail[:1] != ["io_uring"] or "aio" not in avail:
        pytest.skip(f"needs io_uring (auto's choice) and aio; available here: {avail}")
    speed = {"io_uring": 1.0, "aio": 3.0, "posix": 2.0}

    async def fake(f, op, view, offset):
        cfg = f._ops.config
        gbps = speed[cfg.backend] * (1 + cfg.block_size / (8 << 20)) * (1.1 if op == "read" else 1.0)
        return view.numel() / (gbps * 1e9)

    monkeypatch.setattr(_tune, "_timed", fake)
    out = tmp_path / "fake"
    assert main(["tune", "--dir", data_dir, "--out", str(out), *SMALL_TUNE]) == 0
    text = capsys.readouterr().out
    rows = list(csv.DictReader(out.with_suffix(".csv").read_text().splitlines()))
    screening = [r for r in rows if r["rung"] == "1"]
    stopped = {r["backend"] for r in screening if r["status"].startswith("early-stopped")}
    assert "io_uring" in stopped  # 1/3.6 of the best: clearly worse
    final = [r for r in rows if r["status"] == "final"]
    assert "aio" in {r["backend"] for r in final} and "io_uring" not in {r["backend"] for r in final}
    best_write = max((r for r in final if r["op"] == "write"), key=lambda r: float(r["gbps_median"]))
    assert best_write["backend"] == "aio" and best_write["block_size"] == str(1 << 20)
    aio = json.loads(out.with_suffix(".json").read_text())["aio"]
    assert (aio["backend"], aio["block_size"]) == ("aio", 1 << 20)  # the winner, named in the block
    assert dsio.IOConfig.from_deepspeed(aio).backend == "aio"
    assert "backend aio" in text
