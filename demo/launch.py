"""Start one torchrun of ``demo/worker.py``, follow it live, and (optionally) SIGKILL one of its ranks.

The driver reads the workers' ``DEMO {json}`` lines from torchrun's stdout (progress bars, the kill
trigger) while a scraper thread polls each rank's Prometheus endpoint (the live swap rate shown on the
bar, the checkpoint bar). Everything else torchrun prints goes to a log file, quoted when a run fails.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

__all__ = ["DemoRunError", "Phase", "run_phase", "scrape"]

WORKER = Path(__file__).resolve().parent / "worker.py"


class DemoRunError(RuntimeError):
    """A training phase did not do what the demo expects (failed, hung, or was not killed)."""


@dataclass(kw_only=True)
class Phase:
    """What one torchrun launch did: its events by kind, scraped samples, wall time, exit status."""

    name: str
    events: list[dict[str, Any]] = field(default_factory=list)
    scrapes: list[dict[str, Any]] = field(default_factory=list)
    returncode: int | None = None
    seconds: float = 0.0
    killed: dict[str, Any] | None = None
    """``{"rank", "pid", "step", "t"}`` of the rank SIGKILLed on purpose."""
    urls: dict[int, str] = field(default_factory=dict)
    """Each rank's /metrics URL, as it printed it."""

    def of(self, event: str, rank: int | None = None) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == event and (rank is None or e["rank"] == rank)]


def scrape(url: str, timeout: float = 5.0) -> dict[str, float]:
    """One scrape of a /metrics URL: {sample name{labels}: value} (rank label dropped)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=timeout) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "rank")
            key = f"{s.name}{{{labels}}}" if labels else s.name
            out[key] = out.get(key, 0.0) + float(s.value)
    return out


def _swap_total(sample: dict[str, float], direction: str) -> float:
    return sum(v for k, v in sample.items() if k.startswith("dstrain_offload_swap_bytes") and direction in k)


class _Scraper(threading.Thread):
    """Polls the phase's metrics URLs every ``interval`` seconds until stopped."""

    def __init__(self, phase: Phase, interval: float, on_sample: Callable[[dict[str, Any]], None]) -> None:
        super().__init__(name="demo-scraper", daemon=True)
        self.phase, self.interval, self.on_sample = phase, interval, on_sample
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.interval):
            for rank, url in list(self.phase.urls.items()):
                try:
                    values = scrape(url)
                except (OSError, ValueError):  # not up yet, or gone (the killed rank)
                    continue
                sample = {
                    "t": time.time(),
                    "rank": rank,
                    "swap_read": _swap_total(values, "direction=read"),
                    "swap_written": _swap_total(values, "direction=write"),
                    "saves": values.get("dsio_checkpoint_saves_total", 0.0),
                }
                self.phase.scrapes.append(sample)
                self.on_sample(sample)


def run_phase(
    name: str,
    worker_args: list[str],
    *,
    records: str,
    env: dict[str, str],
    log: Path,
    steps: int,
    start_step: int,
    saves: int,
    kill_rank: int | None = None,
    kill_after_step: int | None = None,
    timeout: float = 900.0,
) -> Phase:
    """Run one torchrun of 2 ranks to the end (or until the planned kill) with live progress bars."""
    phase = Phase(name=name)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd = [*torchrun, str(WORKER), *worker_args]
    t0 = time.time()
    bar = tqdm(total=steps, initial=start_step, desc=f"{name:9s} steps", unit="step", leave=True)
    cbar = tqdm(total=saves, desc=f"{name:9s} ckpts", unit="ckpt", leave=True)
    last: dict[int, dict[str, Any]] = {}

    def on_sample(sample: dict[str, Any]) -> None:
        prev = last.get(sample["rank"])
        last[sample["rank"]] = sample
        if sample["rank"] == 0:
            done = int(sample["saves"])
            if done > cbar.n:
                cbar.update(done - cbar.n)
        if prev is not None and sample["t"] > prev["t"]:
            dt = sample["t"] - prev["t"]
            rate = (
                sample["swap_read"] - prev["swap_read"] + sample["swap_written"] - prev["swap_written"]
            ) / dt
            bar.set_postfix_str(f"swap rank{sample['rank']} {rate / 1e9:.2f} GB/s (scraped)", refresh=False)

    scraper = _Scraper(phase, 1.0, on_sample)
    with open(log, "a") as logf:
        logf.write(f"\n=== {name}: {' '.join(cmd)}\n")
        logf.flush()
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=logf, text=True, env=env, start_new_session=True
        )
        watchdog = threading.Timer(timeout, lambda: os.killpg(proc.pid, signal.SIGKILL))
        watchdog.start()
        scraper.start()
        pids: dict[int, int] = {}
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                if not line.startswith("DEMO "):
                    logf.write(line)
                    continue
                logf.write(f"[{time.time() - t0:7.2f} s] {line}")
                try:
                    ev = json.loads(line[5:])
                except ValueError:  # a line cut by a crash: the records files hold every event
                    continue
                if ev["event"] == "metrics":
                    pids[ev["rank"]] = ev["pid"]
                    phase.urls[ev["rank"]] = ev["url"]
                    tqdm.write(f"[{name}] rank {ev['rank']} serves Prometheus metrics at {ev['url']}")
                elif ev["event"] == "resumed":
                    tqdm.write(f"[{name}] resumed from committed step {ev['step']} ({ev['path']})")
                elif ev["event"] == "step" and ev["rank"] == 0:
                    bar.update(ev["step"] - bar.n)
                elif ev["event"] == "drained" and ev["rank"] == 0:
                    cbar.update(max(0, cbar.total - cbar.n))  # every save committed
                if (
                    kill_rank is not None
                    and phase.killed is None
                    and ev["event"] == "step"
                    and ev["rank"] == kill_rank
                    and ev["step"] >= (kill_after_step or 0)
                ):
                    os.kill(pids[kill_rank], signal.SIGKILL)  # on purpose: a crash in the middle of the run
                    phase.killed = {
                        "rank": kill_rank,
                        "pid": pids[kill_rank],
                        "step": ev["step"],
                        "t": time.time(),
                    }
                    tqdm.write(
                        f"[{name}] SIGKILL rank {kill_rank} (pid {pids[kill_rank]}) after its step {ev['step']}"
                    )
            phase.returncode = proc.wait()
            logf.write(f"[{time.time() - t0:7.2f} s] torchrun exited {phase.returncode}\n")
        finally:
            watchdog.cancel()
            scraper.stop.set()
            scraper.join()
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            bar.close()
            cbar.close()
    phase.seconds = time.time() - t0
    phase.events = _read_records(records)
    expected_fail = kill_rank is not None
    if not expected_fail and phase.returncode != 0:
        raise DemoRunError(f"{name}: torchrun exited {phase.returncode}; see {log}:\n{_tail(log)}")
    if expected_fail and phase.killed is None:
        raise DemoRunError(
            f"{name}: rank {kill_rank} never reached step {kill_after_step}; see {log}:\n{_tail(log)}"
        )
    return phase


def _read_records(stem: str) -> list[dict[str, Any]]:
    """Every event both ranks wrote to their records files (a line cut by SIGKILL is dropped)."""
    events: list[dict[str, Any]] = []
    for rank in (0, 1):
        path = Path(f"{stem}-rank{rank}.jsonl")
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            try:
                events.append(json.loads(line))
            except ValueError:
                continue
    return sorted(events, key=lambda e: e["t"])


def _tail(path: Path, lines: int = 30) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])
