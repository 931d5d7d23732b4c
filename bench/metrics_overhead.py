"""What the Prometheus exporter costs the I/O path: 64 KiB op rate with and without it.

One process does 64 KiB O_DIRECT writes and reads (batches of 32 in flight on one open file)
and counts operations in short windows that alternate between "on" (``dsio.metrics.serve()``
running on a loopback port that a real Prometheus scrapes every second) and "off" (no exporter:
the server is shut down, only the handle's weak tracking remains). Windows alternate in ABBA
order because the disk and the neighbours on this machine drift; the result is the median op
rate of each mode, the median of the paired on/off ratios, the scrapes actually served, and the
CPU time of one scrape measured directly. Prometheus runs on the same 2 cores, so its own
scraping cost counts against "on" (pessimistic).

    .venv/bin/python bench/metrics_overhead.py [--dir /path/on/disk] [--pairs 20] [--window 3]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from bench._common import RESULTS  # noqa: E402

OP = 64 << 10
BATCH = 32


class _ScrapeCounter:
    """A collector that only counts how often the exporter was scraped."""

    def __init__(self) -> None:
        self.n = 0

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> list[Any]:
        self.n += 1
        return []


async def _windows(path: str, pairs: int, window: float, port: int) -> dict[str, Any]:
    import torch
    from prometheus_client import CollectorRegistry
    from prometheus_client.process_collector import ProcessCollector

    import dsio
    import dsio.metrics
    from dsio._memory import aligned_buffer

    rates: dict[str, list[float]] = {"off": [], "on": []}
    cpu: dict[str, list[float]] = {"off": [], "on": []}
    paired: list[float] = []
    paired_cpu: list[float] = []
    scrapes: list[int] = []
    async with dsio.AsyncIOHandle(queue_depth=BATCH) as h:
        dsio.metrics.track(h)  # what AsyncIOHandle does for itself: a weak reference, in both modes
        bufs = [torch.frombuffer(aligned_buffer(OP), dtype=torch.uint8) for _ in range(BATCH)]
        async with h.open(path, "w+") as f:
            f.truncate(OP * BATCH)

            async def batch() -> None:
                await asyncio.gather(*(f.pwrite(b, i * OP) for i, b in enumerate(bufs)))
                await asyncio.gather(*(f.pread(b, i * OP) for i, b in enumerate(bufs)))

            async def measure(seconds: float) -> tuple[float, float]:
                """(ops per wall second, process CPU seconds per op: every thread, kernel time included)."""
                ops = 0
                c0, t0 = time.process_time(), time.perf_counter()
                while time.perf_counter() - t0 < seconds:
                    await batch()
                    ops += 2 * BATCH
                return ops / (time.perf_counter() - t0), (time.process_time() - c0) / ops

            await measure(2.0)  # warm-up
            for i in range(pairs):
                got: dict[str, tuple[float, float]] = {}
                for mode in ("off", "on") if i % 2 == 0 else ("on", "off"):
                    srv = counter = None
                    if mode == "on":
                        reg = CollectorRegistry()
                        ProcessCollector(registry=reg)
                        counter = _ScrapeCounter()
                        reg.register(counter)
                        srv = dsio.metrics.serve(port=port, registry=reg)
                    await measure(0.2)  # settle
                    got[mode] = await measure(window)
                    rates[mode].append(got[mode][0])
                    cpu[mode].append(got[mode][1])
                    if srv is not None and counter is not None:
                        srv.close()
                        scrapes.append(counter.n)
                paired.append(got["on"][0] / got["off"][0])
                paired_cpu.append(got["on"][1] / got["off"][1])
                print(
                    f"pair {i + 1}: off {got['off'][0]:,.0f} ops/s {got['off'][1] * 1e6:.1f} us CPU/op, "
                    f"on {got['on'][0]:,.0f} ops/s {got['on'][1] * 1e6:.1f} us CPU/op"
                )
        return {
            "rates": rates,
            "cpu": cpu,
            "paired": paired,
            "paired_cpu": paired_cpu,
            "scrapes": scrapes,
            "backend": h.backend,
        }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape_cost(n: int = 2000) -> dict[str, float]:
    """CPU time of one scrape (collect + text encoding) with one live handle."""
    from prometheus_client import CollectorRegistry, generate_latest

    import dsio
    import dsio.metrics

    async def run() -> dict[str, float]:
        async with dsio.AsyncIOHandle() as h:
            reg = CollectorRegistry()
            dsio.metrics.register(reg)
            dsio.metrics.track(h)
            body = generate_latest(reg)
            t0 = time.process_time()
            for _ in range(n):
                generate_latest(reg)
            per = (time.process_time() - t0) / n
            dsio.metrics.untrack(h)
            return {"seconds_per_scrape": per, "bytes_per_scrape": len(body)}

    return asyncio.run(run())


class Scraper:
    """A real Prometheus scraping 127.0.0.1:port every second, or a Python stand-in."""

    def __init__(self, port: int, tmp: str) -> None:
        self.kind = "prometheus"
        exe = shutil.which("prometheus")
        self.web = f"127.0.0.1:{_free_port()}"
        if exe:
            cfg = os.path.join(tmp, "prometheus.yml")
            with open(cfg, "w") as f:
                f.write(
                    "global:\n  scrape_interval: 1s\n"
                    f"scrape_configs:\n  - job_name: dsio\n    static_configs:\n      - targets: ['127.0.0.1:{port}']\n"
                )
            cmd = [
                exe,
                f"--config.file={cfg}",
                f"--storage.tsdb.path={tmp}/tsdb",
                f"--web.listen-address={self.web}",
            ]
            cmd.append("--log.level=error")
        else:
            self.kind = "python scraper (prometheus not installed)"
            code = (
                "import time, urllib.request\n"
                "while True:\n"
                f"    try: urllib.request.urlopen('http://127.0.0.1:{port}/metrics', timeout=1).read()\n"
                "    except OSError: pass\n"
                "    time.sleep(1)\n"
            )
            cmd = [sys.executable, "-c", code]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(2)

    def scrapes(self, seconds: float) -> int | None:
        """Successful scrapes of the target in the last ``seconds`` (Prometheus only)."""
        if self.kind != "prometheus":
            return None
        q = urllib.parse.urlencode({"query": f"count_over_time(dsio_info[{int(seconds)}s])"})
        try:
            with urllib.request.urlopen(f"http://{self.web}/api/v1/query?{q}", timeout=5) as r:
                res = json.loads(r.read())["data"]["result"]
        except OSError:
            return None
        return int(float(res[0]["value"][1])) if res else 0

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="directory on the disk under test (default: a temp dir)")
    ap.add_argument("--pairs", type=int, default=20, help="on/off window pairs (default 20)")
    ap.add_argument("--window", type=float, default=3.0, help="seconds per window (default 3)")
    ap.add_argument(
        "--out", default=RESULTS, help="result folder (default: $DSIO_BENCH_RESULTS, else bench/results)"
    )
    ap.add_argument("--quick", action="store_true", help="seconds (make bench): 2 window pairs of 1 s")
    args = ap.parse_args()
    if args.quick:
        args.pairs, args.window = 2, 1.0

    tmp = tempfile.mkdtemp(prefix="dsio-metrics-bench-", dir=args.dir)
    port = _free_port()
    scraper = Scraper(port, tmp)
    try:
        res = asyncio.run(_windows(os.path.join(tmp, "ops.bin"), args.pairs, args.window, port))
    finally:
        scraper.close()
        shutil.rmtree(tmp, ignore_errors=True)
    cost = _scrape_cost()
    runs, pairs, scrapes = res["rates"], res["paired"], res["scrapes"]
    med = {m: statistics.median(v) for m, v in runs.items()}
    drop_median = 1 - med["on"] / med["off"]
    drop_paired = 1 - statistics.median(pairs)
    cpu, pcpu = res["cpu"], res["paired_cpu"]
    cmed = {m: statistics.median(v) for m, v in cpu.items()}
    cpu_up = statistics.median(pcpu) - 1
    q = statistics.quantiles(pairs, n=4)
    now = dt.datetime.now(dt.timezone.utc)
    today, stamp = now.strftime("%Y-%m-%d"), now.strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"# dsio.metrics overhead, {stamp}",
        "",
        f"Host {platform.node()}: {os.cpu_count()} cores, kernel {platform.release()}, backend {res['backend']}. "
        f"`bench/metrics_overhead.py --pairs {args.pairs} --window {args.window:g}`.",
        "",
        f"Workload: {OP >> 10} KiB O_DIRECT writes and reads, batches of {BATCH} in flight on one open file, "
        f'one process, {args.window:g} s windows alternating (ABBA) between "on" (`dsio.metrics.serve()` up, '
        f'scraped every 1 s by {scraper.kind} running on the same cores) and "off" (no exporter; the '
        "handle stays weakly tracked, as every handle is).",
        "",
        "| mode | windows | median ops/s | min | max | median CPU us/op | min | max |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for m in ("off", "on"):
        v, c = runs[m], [x * 1e6 for x in cpu[m]]
        lines.append(
            f"| {m} | {len(v)} | {med[m]:,.0f} | {min(v):,.0f} | {max(v):,.0f} "
            f"| {cmed[m] * 1e6:.2f} | {min(c):.2f} | {max(c):.2f} |"
        )
    lines += [
        "",
        f"- Drop of the medians: **{drop_median * 100:+.2f}%**; median of the paired on/off ratios "
        f"{statistics.median(pairs):.4f} (drop {drop_paired * 100:+.2f}%). Target: under 3%.",
        "- Paired op-rate ratios: " + ", ".join(f"{p:.3f}" for p in pairs) + ".",
        f"- CPU per op (process CPU time of all threads, kernel included, per operation; far less sensitive to "
        f"the neighbours than wall-clock rate): median on/off ratio {statistics.median(pcpu):.4f} "
        f"(**{cpu_up * 100:+.2f}%** CPU per op with the exporter); medians {cmed['off'] * 1e6:.2f} vs "
        f'{cmed["on"] * 1e6:.2f} us; the process used {med["off"] * cmed["off"]:.0%} of one core in "off" '
        "windows, so the rate is bound by I/O latency and the exporter's cost shows as CPU rather than rate.",
        f'- Scrapes served per "on" window: {scrapes}.',
        f"- One scrape costs {cost['seconds_per_scrape'] * 1e6:.0f} us of CPU ({cost['bytes_per_scrape']:,} bytes "
        f"of text, one live handle): {cost['seconds_per_scrape'] * 100:.3f}% of one core at one scrape per "
        "second, taken in the exporter's thread (holding the GIL while it collects).",
        "- The I/O path never calls prometheus-client: tracking is one weak reference taken when a handle "
        "is created; counters are read from `statistics()` snapshots only when scraped.",
        f"- Noise: the paired op-rate ratios span {min(pairs):.2f}-{max(pairs):.2f} (quartiles "
        f"{q[0]:.3f} / {q[2]:.3f}); the neighbours on this shared 2-core machine and the host-cached disk "
        "move the rate far more than the exporter does.",
        "",
        "**Verdict:** "
        + (
            "no measurable cost. Both op-rate estimates are under the 3% target, but on this machine the op "
            "rate alone cannot resolve 3% (see the quartiles); CPU per op can, and it is unchanged within "
            f"{max(abs(cpu_up) * 100, 0.1):.1f}%."
            if drop_median < 0.03 and drop_paired < 0.03 and cpu_up < 0.03
            else "over or near the 3% target in at least one estimate; rerun on a quiet machine before concluding."
        ),
        "",
    ]
    modes = {
        m: {
            "windows": len(runs[m]),
            "ops_per_s_median": med[m],
            "ops_per_s_min": min(runs[m]),
            "ops_per_s_max": max(runs[m]),
            "cpu_us_per_op_median": cmed[m] * 1e6,
            "cpu_us_per_op_min": min(cpu[m]) * 1e6,
            "cpu_us_per_op_max": max(cpu[m]) * 1e6,
        }
        for m in ("off", "on")
    }
    data = {  # the schema scripts/readme_numbers.py reads (README's metrics figures come from it)
        "kind": "metrics_overhead",
        "meta": {
            "date": stamp,
            "host": platform.node(),
            "cores": os.cpu_count(),
            "kernel": platform.release(),
            "backend": res["backend"],
            "command": f"bench/metrics_overhead.py --pairs {args.pairs} --window {args.window:g}",
            "scraper": scraper.kind,
        },
        "modes": modes,
        "drop_of_medians_pct": drop_median * 100,
        "paired_ratio_median": statistics.median(pairs),
        "drop_of_paired_pct": drop_paired * 100,
        "paired_ratios": pairs,
        "cpu_ratio_median": statistics.median(pcpu),
        "cpu_per_op_change_pct": cpu_up * 100,
        "busy_off_pct": med["off"] * cmed["off"] * 100,
        "scrapes_per_on_window": scrapes,
        "scrape_cpu_us": cost["seconds_per_scrape"] * 1e6,
        "scrape_bytes": cost["bytes_per_scrape"],
        "verdict": lines[-2].removeprefix("**Verdict:** "),
        "rates": runs,
        "cpu_seconds_per_op": cpu,
    }
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"metrics-{today}{'-quick' if args.quick else ''}.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    with open(path[:-3] + ".json", "w") as f:
        json.dump(data, f, indent=1)
    print("\n".join(lines))
    print(f"wrote {path} and {os.path.basename(path[:-3])}.json")


if __name__ == "__main__":
    main()
