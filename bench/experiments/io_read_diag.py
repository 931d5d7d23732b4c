"""Where read time goes (issue 17): one cold read per case, with what the device and the kernel saw.

    python bench/experiments/io_read_diag.py [--size-mib 512] [--reps 2] [--strace] [--cases "dsio fresh;DeepSpeed locked"]

Per case (dsio into a locked / touched / fresh / fresh page-aligned destination, DeepSpeed's
``aio_handle()`` into its own locked buffer) and rep, page cache dropped and checked first:
GB/s; minor/major page faults and user/system CPU of the reading process (getrusage); requests
completed by the device and their mean size (/proc/diskstats deltas); requests in flight at the
device, sampled every 2 ms (/sys/block/DEV/inflight); dsio's engine counters (request latency
histogram, pieces, submit/wait syscalls, prefault work). With --strace, the syscall counts of one
DeepSpeed read and one dsio read (strace -f -c). Prints JSON lines and a markdown summary.

With --timeline, every dsio read records the engine's per-piece timeline (when each piece was
submitted and completed, on which worker; when each staging copy started and ended, on which
thread) and the JSON line gains its summary (``timeline_summary``): the share of the read's wall
time with no piece in flight at the engine, the time-weighted mean in flight, the copier's busy
share and the share of copy time during which nothing was in flight (the disk idle behind a copy).
"dsio ..., worker copy" cases are the A/B baseline of the copier thread (the reaping worker copies
each piece itself, as before it); ", memcpy" cases copy with glibc's memcpy instead of streaming
stores; "worker copy, memcpy" is the pipeline as it was before the copier. ", at 64" cases read a
file whose data starts at offset 64, where a torch tensor's body (64 mod 4096) goes O_DIRECT.
", 4k pool" cases read through a second handle whose staging pool is on 4 KiB pages (the A/B of
the huge-page pool, ``PinnedPool(hugepage=False)``); ``--pools N`` gives each kind N handles,
used in turn, because a 4 KiB pool's speed depends on where its pages landed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from statistics import median

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import torch  # noqa: E402

import dsio  # noqa: E402
import dsio._transfer as transfer  # noqa: E402
import dsio.pool  # noqa: E402
from bench._common import deepspeed_python, drop_caches_verified, scratch_dir  # noqa: E402
from bench._io_runners import DS_SCRIPT  # noqa: E402
from bench.io_read_path import DeepSpeedServer, _prepare  # noqa: E402
from dsio._native import native  # noqa: E402
from dsio._tuning import SWITCHES  # noqa: E402

PREFAULT_DEFAULT = transfer.PREFAULT_MIN_BYTES
CASES = (
    "dsio locked",
    "dsio touched",
    "dsio touched, loop copy",
    "dsio touched, per-buffer",
    "dsio touched, worker copy",
    "dsio touched, worker copy, memcpy",
    "dsio touched, 1 copier",
    "dsio touched, memcpy",
    "dsio touched, 4k pool",
    "dsio fresh",
    "dsio fresh, loop copy",
    "dsio fresh, per-buffer",
    "dsio fresh, worker copy",
    "dsio fresh, worker copy, memcpy",
    "dsio fresh, 1 copier",
    "dsio fresh, memcpy",
    "dsio fresh, 4k pool",
    "dsio fresh, hugepage",
    "dsio fresh aligned, hugepage",
    "dsio touched, at 64",
    "dsio fresh, at 64",
    "dsio fresh, prefault off",
    "dsio fresh aligned",
    "dsio fresh aligned, prefault off",
    "DeepSpeed locked",
)


def block_device(path: str) -> str:
    """The /sys/block name holding ``path`` (the whole disk, for inflight and diskstats)."""
    st = os.stat(path)
    link = os.path.realpath(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    if os.path.exists(os.path.join(link, "partition")):
        link = os.path.dirname(link)
    return os.path.basename(link)


def diskstats(dev: str) -> tuple[int, int]:
    """(reads completed, sectors read) of ``dev``."""
    with open("/proc/diskstats") as f:
        for line in f:
            p = line.split()
            if p[2] == dev:
                return int(p[3]), int(p[5])
    return 0, 0


TRACE_SUBMIT, TRACE_COMPLETE, TRACE_COPY_START, TRACE_COPY_END = 0, 1, 2, 3


def timeline_summary(events: list[tuple[int, int, int, int]], t_start_ns: int, t_end_ns: int) -> dict:
    """What the per-piece timeline says about one read (events from ``Engine.trace_take``)."""
    if not events:
        return {}
    events = sorted(events)
    wall = max(1, t_end_ns - t_start_ns)
    inflight = copying = 0
    last = t_start_ns
    idle_ns = weighted = copy_ns = copy_idle_ns = 0
    max_idle_gap = cur_gap = 0
    submits_during_copy = 0
    copy_threads: set[int] = set()
    for t, kind, thread, _pos in events:
        dt = t - last
        weighted += inflight * dt
        if inflight == 0:
            idle_ns += dt
            cur_gap += dt
            max_idle_gap = max(max_idle_gap, cur_gap)
        else:
            cur_gap = 0
        if copying:
            copy_ns += dt
            if inflight == 0:
                copy_idle_ns += dt
        last = t
        if kind == TRACE_SUBMIT:
            inflight += 1
            submits_during_copy += copying > 0
        elif kind == TRACE_COMPLETE:
            inflight -= 1
        elif kind == TRACE_COPY_START:
            copying += 1
            copy_threads.add(thread)
        elif kind == TRACE_COPY_END:
            copying -= 1
    tail = max(0, t_end_ns - last)  # after the last event: completion reaching the caller
    pieces = sum(1 for e in events if e[1] == TRACE_SUBMIT)
    return {
        "pieces": pieces,
        "engine_idle_share": round((idle_ns + tail) / wall, 3),
        "inflight_mean": round(weighted / wall, 1),
        "max_idle_gap_ms": round(max_idle_gap / 1e6, 2),
        "copy_busy_share": round(copy_ns / wall, 3),
        "copy_with_nothing_in_flight_share": round(copy_idle_ns / max(1, copy_ns), 3),
        "submits_during_copy": submits_during_copy,
        "copy_threads": sorted(copy_threads),
        "first_submit_ms": round((events[0][0] - t_start_ns) / 1e6, 2),
        "after_last_event_ms": round(tail / 1e6, 2),
    }


class InflightSampler(threading.Thread):
    def __init__(self, dev: str) -> None:
        super().__init__(daemon=True)
        self.dev, self.samples, self.stop = dev, [], False

    def run(self) -> None:
        while not self.stop:
            with open(f"/sys/block/{self.dev}/inflight") as f:
                self.samples.append(int(f.read().split()[0]))
            time.sleep(0.002)


def measure(
    case: str, loop, h, ds, path: str, size: int, locked, touched, dev: str, timeline: bool = False, h4k=None
) -> dict:
    cold = drop_caches_verified(path + ".at64" if case.endswith("at 64") else path)
    if case.endswith("4k pool"):
        h = h4k  # the same engine settings below, on a handle whose pool is on 4 KiB pages
    # The A/B of the prefault thread: the same read with the threshold out of reach.
    transfer.PREFAULT_MIN_BYTES = 1 << 62 if case.endswith("prefault off") else PREFAULT_DEFAULT
    # The A/B of the native staging copy: "loop copy" copies pool -> tensor on the loop thread.
    SWITCHES.loop_thread_copy = case.endswith("loop copy")
    # The A/B of ring staging: "per-buffer" is one engine request per pool buffer (the loop
    # hands each buffer back) instead of one request cycling block_size slots in the workers.
    SWITCHES.ring_staging = not case.endswith("per-buffer")
    # The A/B of the copier thread: "worker copy" makes the reaping worker copy each piece itself.
    # The A/B of streaming stores for those copies: "memcpy" uses glibc's memcpy.
    h._engine.copy_streaming = "memcpy" not in case
    # The A/B of huge pages for fresh destinations (prefault advises MADV_HUGEPAGE first).
    h._engine.prefault_hugepage = case.endswith("hugepage")
    h._engine.copy_threads = 0 if "worker copy" in case else (1 if case.endswith("1 copier") else 2)
    if case.startswith("dsio fresh aligned"):
        dest = torch.frombuffer(native().AlignedBuffer(size, False), dtype=torch.uint8)
    elif case.startswith("dsio fresh"):
        dest = torch.empty(size, dtype=torch.uint8)
    else:
        dest = locked if case == "dsio locked" else touched
    st0 = h._engine.statistics()
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    d0 = diskstats(dev)
    s = InflightSampler(dev)
    s.start()
    if case.startswith("DeepSpeed"):
        r = ds.call("read", path, 0, size)
        dt, own = r["seconds"], {"minflt": r["minflt"], "utime": r["utime"], "stime": r["stime"]}
    else:
        if timeline:
            h._engine.trace_start(4 * (size // h._engine.block_size + 64))
        t0 = time.perf_counter()
        t0_ns = time.monotonic_ns()
        # "at 64": the tensor sits at file offset 64 (a second file), so a torch tensor at 64 mod
        # 4096 has (address - offset) % 4096 == 0: its whole body goes O_DIRECT, nothing staged.
        at = 64 if case.endswith("at 64") else 0
        loop.run_until_complete(h.pread(dest, path + ".at64" if at else path, at))
        t1_ns = time.monotonic_ns()
        dt = time.perf_counter() - t0
        own = None
        events = h._engine.trace_take() if timeline else []
    s.stop = True
    s.join()
    d1 = diskstats(dev)
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    st1 = h._engine.statistics()
    reqs, sectors = d1[0] - d0[0], d1[1] - d0[1]
    out = {
        "case": case,
        "cold": cold,
        "gbps": size / dt / 1e9,
        "device_requests": reqs,
        "device_mean_kib": sectors * 512 / reqs / 1024 if reqs else 0.0,
        "inflight_median": median(s.samples) if s.samples else 0,
        "inflight_max": max(s.samples) if s.samples else 0,
        "device_idle_samples_share": round(sum(1 for x in s.samples if x == 0) / len(s.samples), 3)
        if s.samples
        else 0.0,
    }
    if own is not None:
        out.update(own)
    else:
        out.update(
            minflt=ru1.ru_minflt - ru0.ru_minflt,
            majflt=ru1.ru_majflt - ru0.ru_majflt,
            utime=ru1.ru_utime - ru0.ru_utime,
            stime=ru1.ru_stime - ru0.ru_stime,
            requests=st1["read"]["ops"] - st0["read"]["ops"],
            pieces=st1["pieces"] - st0["pieces"],
            submit_syscalls=st1["submit_syscalls"] - st0["submit_syscalls"],
            wait_syscalls=st1["wait_syscalls"] - st0["wait_syscalls"],
            native_copy_bytes=st1["copy"]["bytes"] - st0["copy"]["bytes"],
            native_copy_busy_s=(st1["copy"]["busy_ns"] - st0["copy"]["busy_ns"]) / 1e9,
            latency_hist_us={
                f"<{2**i}": b - a
                for i, (a, b) in enumerate(zip(st0["read"]["latency_hist"], st1["read"]["latency_hist"]))
                if b - a
            },
            piece_latency_hist_us={
                f"<{2**i}": b - a
                for i, (a, b) in enumerate(
                    zip(st0["read"]["piece_latency_hist"], st1["read"]["piece_latency_hist"])
                )
                if b - a
            },
            prefaulted_mib=(st1["prefault"]["populated_bytes"] - st0["prefault"]["populated_bytes"]) / 2**20,
            prefault_skipped_mib=(st1["prefault"]["resident_bytes"] - st0["prefault"]["resident_bytes"])
            / 2**20,
            prefault_s=(st1["prefault"]["busy_ns"] - st0["prefault"]["busy_ns"]) / 1e9,
            copy_backlog_max=st1["copy"]["backlog_max"],
        )
        if timeline:
            out["timeline_summary"] = timeline_summary(events, t0_ns, t1_ns)
    return out


def strace_counts(ds_py: str | None, path: str, size: int) -> dict[str, str]:
    """``strace -f -c`` of one DeepSpeed read and one dsio read (locked buffers, cold)."""
    if shutil.which("strace") is None:
        return {"note": "strace not installed (apt-get install strace)"}
    trace = "trace=io_submit,io_getevents,io_uring_enter,pread64,madvise,mincore,mlock"
    out = {}
    dsio_code = (
        "import asyncio, torch, dsio\nfrom dsio._native import native\n"
        f"b = torch.frombuffer(native().AlignedBuffer({size}, True), dtype=torch.uint8)\n"
        "async def m():\n"
        "    async with dsio.AsyncIOHandle() as h:\n"
        f"        await h.pread(b, {path!r})\n"
        "asyncio.run(m())\n"
    )
    cmds = {"dsio (IOConfig defaults)": [sys.executable, "-c", dsio_code]}
    if ds_py:
        cmds["DeepSpeed aio_handle()"] = [
            ds_py,
            DS_SCRIPT,
            "--path",
            path,
            "--size",
            str(size),
            "--mode",
            "read",
        ]
    for name, cmd in cmds.items():
        drop_caches_verified(path)
        r = subprocess.run(
            ["strace", "-f", "-c", "-e", trace, *cmd], capture_output=True, text=True, timeout=600
        )
        out[name] = "\n".join(
            line for line in r.stderr.splitlines() if "%" in line or "syscall" in line or line[:1] == " "
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--ds-python", default=None)
    ap.add_argument("--strace", action="store_true")
    ap.add_argument("--timeline", action="store_true", help="per-piece timeline summary of each dsio read")
    ap.add_argument("--cases", default=None, help="semicolon-separated subset of: " + "; ".join(CASES))
    ap.add_argument("--pools", type=int, default=1, help="handles per pool kind, used in turn (rep by rep)")
    args = ap.parse_args()
    cases = CASES if args.cases is None else tuple(c.strip() for c in args.cases.split(";"))
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        ap.error(f"unknown cases {unknown}; known: {list(CASES)}")
    d = args.dir or scratch_dir()
    os.makedirs(d, exist_ok=True)
    size = args.size_mib << 20
    path = os.path.join(d, f"diag-{args.size_mib}.bin")
    _prepare(path, 0, size)
    if any(c.endswith("at 64") for c in cases):
        _prepare(path + ".at64", 64, size)
    dev = block_device(path)
    ds_py = deepspeed_python(args.ds_python)
    ds = DeepSpeedServer(ds_py, DS_SCRIPT, size) if ds_py else None
    loop = asyncio.new_event_loop()
    hs = [dsio.AsyncIOHandle() for _ in range(args.pools)]
    SWITCHES.hugepages = False  # the A/B handles: staging pools on 4 KiB pages
    hs4k = [dsio.AsyncIOHandle() for _ in range(args.pools)] if any("4k pool" in c for c in cases) else []
    SWITCHES.hugepages = True
    locked = torch.frombuffer(native().AlignedBuffer(size, True), dtype=torch.uint8)
    touched = torch.ones(size, dtype=torch.uint8)
    rows = []
    try:
        for rep in range(args.reps):
            for case in cases:
                if case.startswith("DeepSpeed") and ds is None:
                    continue
                h = hs[rep % len(hs)]
                h4k = hs4k[rep % len(hs4k)] if hs4k else None
                rec = measure(case, loop, h, ds, path, size, locked, touched, dev, args.timeline, h4k)
                rec["pool"] = rep % len(hs)
                print(json.dumps(rec), flush=True)
                rows.append(rec)
    finally:
        for h in (*hs, *hs4k):
            loop.run_until_complete(h.aclose())
        if ds is not None:
            ds.close()
    if args.strace:
        for name, text in strace_counts(ds_py, path, size).items():
            print(f"\n## strace -f -c: {name}\n{text}")
    os.unlink(path)
    if os.path.exists(path + ".at64"):
        os.unlink(path + ".at64")


if __name__ == "__main__":
    main()
