"""The Grafana dashboard queries only what dsio (and dstrain's offload, on dsio's exporter) exports.

A real Prometheus (Debian's ``prometheus`` package, obtained by scripts/install_prometheus.sh
when missing, with or without root) runs on loopback with a temporary config and data directory, scrapes a live dsio
process under load every second (I/O, a pool, checkpoints, and a dstrain engine training with its
optimizer state offloaded to NVMe), and every PromQL expression of every dashboard panel must
return data through Prometheus's HTTP API.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from _ports import free_port  # tests/_ports.py: a port no concurrent launch picks

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "dsio.json"
RATE_INTERVAL = "10s"  # what $__rate_interval stands for with a 1 s scrape interval


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _targets(dash: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expr) of every query of every panel, rows included."""
    out = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for p in panels:
            for t in p.get("targets", []):
                out.append((p["title"], t["expr"]))
            walk(p.get("panels", []))

    walk(dash["panels"])
    return out


def _promql(expr: str) -> str:
    """The expression Prometheus would get from Grafana with every instance selected."""
    for var, val in (
        ("$__rate_interval", RATE_INTERVAL),
        ("$__interval", "1s"),
        ("${instance}", ".+"),
        ("$instance", ".+"),
    ):
        expr = expr.replace(var, val)
    assert "$" not in expr, f"unhandled Grafana variable in {expr!r}"
    return expr


# -- static checks ------------------------------------------------------------------------------
def test_dashboard_structure():
    dash = _dashboard()
    assert dash["uid"] == "dsio-overview" and dash["title"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    names = {v["name"] for v in dash["templating"]["list"]}
    assert names == {"datasource", "instance"}
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for topic in (
        "throughput",
        "iops",
        "latency",
        "in flight",
        "pool",
        "error",
        "checkpoint",
        "blocked",
        "offload",
        "swap",
        "stall",
        "prefetch",
        "pinned",
        "loss",
        "learning rate",
        "gradient norm",
        "tokens per second",
        "mfu",
    ):
        assert topic in titles, f"no panel about {topic}"
    for p in dash["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["h"] > 0
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert p["targets"], p["title"]
            for t in p["targets"]:
                assert t["datasource"] == p["datasource"] and t["refId"]
    exprs = [e for _, e in _targets(dash)]
    assert len(exprs) >= 20
    assert any("histogram_quantile(0.99" in e for e in exprs) and any(
        "histogram_quantile(0.5" in e for e in exprs
    )
    for e in exprs:
        assert 'instance=~"$instance"' in e, f"panel query ignores the instance variable: {e}"
        assert e.count("(") == e.count(")"), e


def test_provisioning_points_at_the_dashboard_and_datasource():
    ds = (GRAFANA / "provisioning" / "datasources" / "dsio.yaml").read_text()
    assert re.search(r"^apiVersion: 1$", ds, re.M)
    assert re.search(r"^\s+uid: dsio-prometheus$", ds, re.M)
    assert re.search(r"^\s+type: prometheus$", ds, re.M)
    assert re.search(r"^\s+url: http://localhost:9090$", ds, re.M)
    dash = _dashboard()
    ds_var = next(v for v in dash["templating"]["list"] if v["name"] == "datasource")
    assert ds_var["current"]["value"] == "dsio-prometheus" and ds_var["query"] == "prometheus"

    prov = (GRAFANA / "provisioning" / "dashboards" / "dsio.yaml").read_text()
    assert re.search(r"^apiVersion: 1$", prov, re.M) and re.search(r"^\s+type: file$", prov, re.M)
    m = re.search(r"^\s+path: (.+)$", prov, re.M)
    assert m
    # Grafana expands ${GF_PATHS_PROVISIONING}: pointed at grafana/provisioning, the path is grafana/dashboards.
    path = m.group(1).strip().replace("${GF_PATHS_PROVISIONING}", str(GRAFANA / "provisioning"))
    assert os.path.realpath(path) == str(DASHBOARD.parent)
    assert any(f.suffix == ".json" for f in DASHBOARD.parent.iterdir())


# -- the live test ----------------------------------------------------------------------------------
LOAD = r"""
import asyncio, os, sys, threading, time
import torch
import dsio, dsio.metrics
from dsio.checkpoint import Checkpointer

port_file, d, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])

async def io_load(h, stop):
    from dsio import _C
    aligned = torch.frombuffer(_C.AlignedBuffer(1 << 20, True), dtype=torch.uint8)
    plain = torch.ones(65536 + 100, dtype=torch.uint8)   # unaligned size: staged + buffered tail
    path = os.path.join(d, "load.bin")
    i = 0
    async with h.open(path, "w+") as f:
        while not stop.is_set():
            await asyncio.gather(*(f.pwrite(aligned[:65536], offset=k * 65536) for k in range(32)))
            await asyncio.gather(*(f.pread(aligned[:65536], offset=k * 65536) for k in range(32)))
            await f.pwrite(aligned, offset=4 << 20)
            await h.pwrite(plain, os.path.join(d, "plain.bin"), fsync=(i % 4 == 0))
            await h.pread(plain, os.path.join(d, "plain.bin"))
            if i % 10 == 0:  # an engine error: a read on a write-only file
                async with h.open(path, "w") as wo:
                    try:
                        await wo.pread(aligned[:4096])
                    except dsio.IOFailedError:
                        pass
            i += 1
            await asyncio.sleep(0.005)

async def pool_load(pool, stop):
    async def user():
        while not stop.is_set():
            async with pool.buffer():
                await asyncio.sleep(0.02)
    await asyncio.gather(*(user() for _ in range(4)))   # 4 users, 2 buffers: waiters

async def ckpt_load(ck, stop):
    state = {"w": torch.randn(256, 1024), "step": torch.zeros(1)}
    step = 0
    while not stop.is_set():
        step += 1
        await ck.save(step, state)
        await asyncio.sleep(0.3)
        if step % 2 == 0:
            await ck.wait()
            await ck.load()

def train_load(d, stop, ready):
    # a dstrain engine with Adam's state in swap files: dstrain_offload_*{kind="optimizer"}
    import dstrain
    swap = os.path.join(d, "swap")
    os.makedirs(swap, exist_ok=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 256))
    zero = {"stage": 1, "sub_group_size": 16384,
            "offload_optimizer": {"device": "nvme", "nvme_path": swap, "buffer_count": 2}}
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "train_batch_size": 4,
           "optimizer": {"type": "Adam", "params": {"lr": 1e-4}}, "zero_optimization": zero,
           "steps_per_print": 10**9, "gradient_clipping": 1.0,  # clipping: the grad norm is computed
           "flops_profiler": {"enabled": True, "peak_tflops": 1.0, "output_file": os.path.join(d, "flops.txt")}}
    engine, _, _, _ = dstrain.initialize(model=model, config=cfg)
    import dstrain.metrics
    dstrain.metrics.register(engine)  # the training series: dstrain_loss, dstrain_lr, ...
    x = torch.randn(4, 256)
    while not stop.is_set():
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        ready.set()
        time.sleep(0.02)
    engine.close()

async def main():
    srv = dsio.metrics.serve(port=0)
    stop = asyncio.Event()
    train_stop, trained = threading.Event(), threading.Event()
    trainer = threading.Thread(target=train_load, args=(d, train_stop, trained), daemon=True)
    trainer.start()
    while not trained.is_set():  # its metrics exist before the port is announced
        if not trainer.is_alive():
            raise RuntimeError("the offload training thread died")
        await asyncio.sleep(0.1)
    async with dsio.AsyncIOHandle(queue_depth=16) as h, Checkpointer(os.path.join(d, "ckpt"), keep_last=2) as ck:
        with dsio.PinnedPool(2 * 4096, 4096) as pool:
            for obj in (h, ck, pool):
                dsio.metrics.track(obj)
            with open(port_file + ".tmp", "w") as f:
                f.write(str(srv.port))
            os.rename(port_file + ".tmp", port_file)
            tasks = [asyncio.ensure_future(c) for c in (io_load(h, stop), pool_load(pool, stop), ckpt_load(ck, stop))]
            await asyncio.sleep(seconds)  # bounded: the test kills it sooner
            stop.set()
            await asyncio.gather(*tasks)
    train_stop.set()
    trainer.join()
    srv.close()

asyncio.run(main())
"""


def _prometheus_binary() -> str:
    """On PATH, else whatever scripts/install_prometheus.sh obtains (apt-get as root, else Debian's package
    unpacked into .cache/prometheus without root); else skip saying how to enable it (fail under DSIO_CI=1)."""
    from _mount import skip_or_fail

    exe = shutil.which("prometheus")
    if exe:
        return exe
    script = ROOT / "scripts" / "install_prometheus.sh"
    howto = (
        "to run it: `bash scripts/install_prometheus.sh` (as root: apt-get install prometheus; otherwise "
        "apt-get download + dpkg -x into .cache/prometheus), or put a `prometheus` binary on PATH"
    )
    try:
        r = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        skip_or_fail(f"Prometheus is not installed and installing it timed out; {howto}")
    lines = r.stdout.strip().splitlines()
    if r.returncode == 0 and lines and os.access(lines[-1], os.X_OK):
        return lines[-1]
    why = (r.stderr.strip().splitlines() or ["no reason given"])[-1]
    skip_or_fail(
        f"Prometheus is not installed and scripts/install_prometheus.sh could not get it ({why}); {howto}"
    )
    raise AssertionError("unreachable")


def _get(url: str, timeout: float = 10) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read().decode())


def _wait(pred: Any, timeout: float, what: str, procs: list[tuple[subprocess.Popen[Any], Path]]) -> Any:
    """Poll ``pred`` until truthy; fail with the log of any process (Popen, log file) that died."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        for p, log in procs:
            if p.poll() is not None:
                out = log.read_text(errors="replace") if log.is_file() else ""
                pytest.fail(f"{p.args[0]} exited ({p.returncode}) while waiting for {what}:\n{out[-3000:]}")
        try:
            last = pred()
            if last:
                return last
        except OSError as e:
            last = e
        time.sleep(0.5)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")


@pytest.mark.timeout(360)
def test_every_dashboard_query_returns_data_from_a_live_process(tmp_path):
    exe = _prometheus_binary()
    data = tmp_path / "data"
    data.mkdir()
    port_file = tmp_path / "port"
    # Output goes to files, not pipes: a full pipe nobody reads would stall the process under test.
    load_log_path, prom_log_path = tmp_path / "load.log", tmp_path / "prometheus.log"
    load_log, prom_log = load_log_path.open("w"), prom_log_path.open("w")
    load = subprocess.Popen(
        [
            sys.executable,
            "-c",
            LOAD,
            str(port_file),
            str(data),
            "300",
        ],  # outlives the test; killed at the end
        stdout=load_log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    prom: subprocess.Popen[str] | None = None
    try:
        # (starting a dstrain engine with NVMe offload takes a few seconds, ~50 s on a loaded 2-core machine)
        _wait(port_file.exists, 150, "the dsio load process to serve metrics", [(load, load_log_path)])
        target = f"127.0.0.1:{int(port_file.read_text())}"
        cfg = tmp_path / "prometheus.yml"
        cfg.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            f"scrape_configs:\n  - job_name: dsio\n    static_configs:\n      - targets: ['{target}']\n"
        )
        web = f"127.0.0.1:{free_port()}"
        prom = subprocess.Popen(
            [
                exe,
                f"--config.file={cfg}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address={web}",
                "--storage.tsdb.retention.time=1h",
                "--log.level=warn",
            ],
            stdout=prom_log,
            stderr=subprocess.STDOUT,
            text=True,
        )
        api = f"http://{web}/api/v1"

        def query(expr: str) -> dict[str, Any]:
            return _get(f"{api}/query?" + urllib.parse.urlencode({"query": expr}))

        procs = [(load, load_log_path), (prom, prom_log_path)]
        _wait(
            lambda: urllib.request.urlopen(f"http://{web}/-/ready", timeout=2).status == 200,
            60,
            "Prometheus to be ready",
            procs,
        )
        # Enough samples in every rate window: at least 8 scrapes of the target within it.
        _wait(
            lambda: query(f"count_over_time(dsio_info[{RATE_INTERVAL}]) >= 8")["data"]["result"],
            60,
            "Prometheus to scrape the dsio process",
            procs,
        )
        targets = _get(f"{api}/targets")["data"]["activeTargets"]
        assert [t["health"] for t in targets] == ["up"], targets

        # Every dsio metric a panel names is exported by the live process.
        names = set(_get(f"{api}/label/__name__/values")["data"])
        dash = _dashboard()
        exprs = _targets(dash)
        used = {m for _, e in exprs for m in re.findall(r"\b((?:dsio|dstrain)_[a-z0-9_]+)", e)}
        missing = sorted(used - names)
        assert not missing, f"the dashboard queries metrics dsio does not export: {missing}"

        # The instance variable's query (label_values(dsio_info, instance)) finds the process.
        inst = _get(f"{api}/label/instance/values?" + urllib.parse.urlencode({"match[]": "dsio_info"}))[
            "data"
        ]
        assert target in inst

        failures = []
        for title, expr in exprs:
            promql = _promql(expr)
            res = query(promql)
            if res.get("status") != "success":
                failures.append(f"{title}: {promql}: {res}")
                continue
            result = res["data"]["result"]
            values = [float(r["value"][1]) for r in result]
            if not values:
                failures.append(f"{title}: {promql}: no data")
            elif not any(math.isfinite(v) for v in values):
                failures.append(f"{title}: {promql}: only NaN/Inf {values}")
        assert not failures, "dashboard queries without data:\n" + "\n".join(failures)

        # And the data means something: the process is moving bytes and reporting errors.
        def scalar(expr: str) -> float:
            return float(query(_promql(expr))["data"]["result"][0]["value"][1])

        assert scalar(f"sum(rate(dsio_bytes_total{{op='write'}}[{RATE_INTERVAL}]))") > 1e6
        assert scalar(f"sum(rate(dsio_requests_total{{op='read'}}[{RATE_INTERVAL}]))") > 100
        assert scalar(f"sum(increase(dsio_request_errors_total{{op='read'}}[{RATE_INTERVAL}]))") > 0
        assert scalar(f"sum(increase(dsio_checkpoint_saves_total[{RATE_INTERVAL}]))") > 0
        for direction in ("read", "write"):  # the offloaded optimizer swaps every step
            rate = f"rate(dstrain_offload_swap_bytes_total{{kind='optimizer', direction='{direction}'}}[{RATE_INTERVAL}])"
            assert scalar(f"sum({rate})") > 0
        p99 = scalar(
            f"histogram_quantile(0.99, sum by (le) (rate(dsio_request_latency_seconds_bucket{{op='read'}}[{RATE_INTERVAL}])))"
        )
        assert 1e-6 <= p99 < 10
    finally:
        for p in (prom, load):
            if p is not None and p.poll() is None:
                p.kill()
            if p is not None:
                p.wait(timeout=30)
        load_log.close()
        prom_log.close()
