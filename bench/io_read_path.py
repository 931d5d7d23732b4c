"""The read-path benchmark of issue 17: dsio's reads into every kind of destination beside
DeepSpeed's ``aio_handle()`` reading into its own locked buffer, interleaved rep by rep.

    python bench/io.py --read-path [--sizes-mib 512,2048] [--runs 5] [--reps 3]

For each size and layout (``file``: one file per tensor; ``offset``: the tensor 64 MiB into a
file holding another tensor before it), every run measures, rep by rep, each case once with
the page cache dropped (and checked with mincore) right before it:

  dsio read, locked     an mlock'ed page-aligned tensor (what ``dsio.compat``'s
                        ``new_cpu_locked_tensor`` returns): the O_DIRECT-straight-in path
  dsio read, touched    a reused ordinary torch tensor (not 4096-aligned: staged)
  dsio read, fresh      ``torch.empty`` allocated right before the read (what a loader does)
  dsio read, fresh aligned  a page-aligned buffer mapped right before the read (never touched)
  DeepSpeed read        ``aio_handle()`` defaults, its locked buffer allocated once (reference)
  dsio write / DeepSpeed write  the locked buffer to a new file (unlinked first), not fsynced

dsio runs ``IOConfig()`` defaults. Ratios are taken per run (median of its reps over the median
of DeepSpeed's reps in the same run); the report gives the median ratio over runs and its range.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from statistics import median

import torch

import dsio
from bench._common import drop_caches_verified, fmt
from dsio._memory import aligned_buffer

__all__ = ["DeepSpeedServer", "READ_CASES", "run_read_path", "report_read_path"]

MIB = 1 << 20
OFFSET = 64 * MIB  # where the tensor sits in the "offset" layout's file
READ_CASES = ("dsio read, locked", "dsio read, touched", "dsio read, fresh", "dsio read, fresh aligned")
DS_READ = "DeepSpeed read (locked)"
WRITE_CASES = ("dsio write (locked)", "DeepSpeed write (locked)")
TARGETS = {  # issue 17: minimum median ratio to DeepSpeed's read
    "dsio read, locked": 1.0,
    "dsio read, touched": 1.0,
    "dsio read, fresh": 0.95,
    "dsio read, fresh aligned": 0.95,
}


class DeepSpeedServer:
    """``deepspeed_io.py --mode serve`` in the DeepSpeed venv: one handle, one locked buffer."""

    def __init__(self, python: str, script: str, capacity: int, extra: list[str] | None = None) -> None:
        env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [python, script, "--path", "-", "--mode", "serve", "--size", str(capacity), *(extra or [])],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        hello = self._line()
        if not hello.get("ready"):
            raise RuntimeError(f"DeepSpeed server did not start: {hello}")

    def _line(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"DeepSpeed server exited (rc {self.proc.poll()})")
        return json.loads(line)

    def call(self, op: str, path: str, offset: int, size: int) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, "path": path, "offset": offset, "size": size}) + "\n")
        self.proc.stdin.flush()
        res = self._line()
        if not res.get("ok"):
            raise RuntimeError(f"DeepSpeed {op} failed: {res.get('error')}")
        return res

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def prepare(path: str, offset: int, size: int) -> None:
    """A file holding ``offset`` bytes, then the tensor's ``size`` random bytes (untimed)."""
    if os.path.exists(path) and os.path.getsize(path) == offset + size:
        return
    chunk = torch.randint(0, 256, (64 * MIB,), dtype=torch.uint8).numpy().tobytes()
    with open(path, "wb") as f:
        left = offset + size
        while left:
            n = min(left, len(chunk))
            f.write(chunk[:n])
            left -= n
        os.fsync(f.fileno())


def run_read_path(
    directory: str,
    sizes: list[int],
    runs: int,
    reps: int,
    ds_python: str | None,
    ds_script: str,
    progress: Callable[[str], None] = lambda s: None,
) -> dict:
    """Measure every case; returns {"results": {group: {case: [[per-rep GB/s] per run]}}, "records": [...],
    "cold": bool}. A group is "<size MiB> MiB, <layout>"."""
    loop = asyncio.new_event_loop()
    h = dsio.AsyncIOHandle(dsio.IOConfig())
    results: dict = defaultdict(lambda: defaultdict(list))
    records: list[dict] = []
    cold = True
    try:
        for size in sizes:
            ds = DeepSpeedServer(ds_python, ds_script, size) if ds_python else None
            locked_mem = aligned_buffer(size)
            locked = torch.frombuffer(locked_mem, dtype=torch.uint8)
            locked.fill_(3)
            touched = torch.empty(size, dtype=torch.uint8)
            touched.fill_(1)
            try:
                for layout, off in (("file", 0), ("offset", OFFSET)):
                    group = f"{size // MIB} MiB, {layout}"
                    src = os.path.join(directory, f"rp-{size // MIB}-{layout}.bin")
                    dst = os.path.join(directory, f"rp-{size // MIB}-{layout}-w.bin")
                    prepare(src, off, size)
                    for run in range(runs):
                        per: dict[str, list[float]] = defaultdict(list)
                        for rep in range(reps):
                            progress(f"{group}: run {run + 1}/{runs}, rep {rep + 1}/{reps}")
                            for case in (*READ_CASES, DS_READ, *WRITE_CASES):
                                if case.startswith("DeepSpeed") and ds is None:
                                    continue
                                rec = _one(loop, h, ds, case, src, dst, off, size, locked, touched)
                                cold &= rec.get("cold", True)
                                rec.update(group=group, run=run, rep=rep, case=case)
                                records.append(rec)
                                per[case].append(rec["gbps"])
                        for case, xs in per.items():
                            results[group][case].append(xs)
                    for p in (src, dst):
                        if os.path.exists(p):
                            os.unlink(p)
            finally:
                if ds is not None:
                    ds.close()
                del locked, touched, locked_mem
    finally:
        loop.run_until_complete(h.aclose())
        loop.close()
    return {"results": {g: dict(c) for g, c in results.items()}, "records": records, "cold": cold}


def _one(loop, h, ds, case, src, dst, off, size, locked, touched) -> dict:
    """One timed operation, with its page faults and (dsio) prefault work."""
    if "write" in case:
        if os.path.exists(dst):
            os.unlink(dst)
        os.sync()
        if ds is not None and case.startswith("DeepSpeed"):
            r = ds.call("write", dst, off, size)
            return {"gbps": r["gbps"], "minflt": r["minflt"]}
        return _timed(loop, h, lambda: h.pwrite(locked, dst, offset=off if off else None), size)
    rec: dict = {"cold": drop_caches_verified(src)}
    if case == DS_READ:
        r = ds.call("read", src, off, size)
        rec.update(gbps=r["gbps"], minflt=r["minflt"], utime=r["utime"], stime=r["stime"])
        return rec
    if case.endswith("locked"):
        dest = locked
    elif case.endswith("touched"):
        dest = touched
    elif case.endswith("fresh aligned"):
        dest = torch.frombuffer(aligned_buffer(size, lock=False), dtype=torch.uint8)
    else:
        dest = torch.empty(size, dtype=torch.uint8)
    rec.update(_timed(loop, h, lambda: h.pread(dest, src, off), size))
    return rec


def _timed(loop, h, make, size: int) -> dict:
    pf0 = h.statistics().engine.prefaulted_bytes
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    loop.run_until_complete(make())
    dt = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "gbps": size / dt / 1e9,
        "minflt": ru1.ru_minflt - ru0.ru_minflt,
        "utime": ru1.ru_utime - ru0.ru_utime,
        "stime": ru1.ru_stime - ru0.ru_stime,
        "prefaulted_bytes": h.statistics().engine.prefaulted_bytes - pf0,
    }


def _ratios(per_run: list[list[float]], ref_runs: list[list[float]]) -> list[float]:
    return [median(a) / median(b) for a, b in zip(per_run, ref_runs, strict=False) if a and b]


def report_read_path(data: dict, meta: dict, header: str) -> str:
    res = data["results"]
    warm = "" if data["cold"] else " (WARM: the page-cache drop failed or did not take; reads are not cold)"
    lines = [f"# dsio read path vs DeepSpeed, {meta['date']}", "", header + warm, ""]
    lines.append("Machine: " + ", ".join(f"{k} {v}" for k, v in meta.items() if k != "date"))
    lines += ["", "## GB/s, median (min-max) over every rep of every run", ""]
    cases = (*READ_CASES, DS_READ, *WRITE_CASES)
    lines.append("| group | " + " | ".join(cases) + " |")
    lines.append("|---" * (len(cases) + 1) + "|")
    for g, c in res.items():
        cells = [fmt([x for run in c.get(k, []) for x in run]) for k in cases]
        lines.append(f"| {g} | " + " | ".join(cells) + " |")
    lines += ["", "## Ratio to DeepSpeed's read (reads) or write (writes), per run", ""]
    lines.append(
        "Median over runs of (median of the run's reps / DeepSpeed's median in that run), with min-max."
    )
    lines.append("")
    lines.append("| group | case | ratio | target | met |")
    lines.append("|---|---|---|---|---|")
    verdicts = []
    for g, c in res.items():
        for case in (*READ_CASES, WRITE_CASES[0]):
            ref = c.get(DS_READ if "read" in case else WRITE_CASES[1])
            if not ref or case not in c:
                continue
            r = _ratios(c[case], ref)
            target = TARGETS.get(case)
            met = "-" if target is None else ("yes" if median(r) >= target else "no")
            verdicts.append(met)
            lines.append(
                f"| {g} | {case} | {median(r):.2f}x ({min(r):.2f}-{max(r):.2f}) | "
                f"{'-' if target is None else f'>= {target:.2f}x'} | {met} |"
            )
    lines += [
        "",
        f"Targets met: {verdicts.count('yes')} of {verdicts.count('yes') + verdicts.count('no')}.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run through bench/io.py --read-path")
