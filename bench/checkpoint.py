"""Checkpoint benchmark: dsio.checkpoint vs torch.save, safetensors, DCP, and dsio's raw I/O.

    .venv/bin/python bench/checkpoint.py                 # ~3 GiB GPT-like model + AdamW, 3 reps
    .venv/bin/python bench/checkpoint.py --layers 2 --reps 1 --no-write   # quick smoke run

Every method runs once per rep, methods interleaved rep by rep (the disk here is noisy: see
../shared/ANCHORS.md); medians with min-max. Every save is durable (fsync) and writes a new
file; loads start from a dropped page cache (``sync; echo 3 > /proc/sys/vm/drop_caches``).
The ceiling is dsio's raw sequential write/read of the same number of bytes from/into
page-aligned memory. Results go to bench/results/checkpoint-<date>.json (every rep, the targets),
.md (the report) and .png; README's checkpoint figures are generated from the JSON
(scripts/readme_numbers.py). Without root the page cache cannot be dropped: the report then says
so and labels the loads warm.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import operator
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from tqdm import tqdm

import dsio
import dsio.checkpoint as C
from dsio._tuning import switched
from dsio.checkpoint._integrity import crc_of, crc_path
from dsio.checkpoint._state import flatten

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from bench._common import RESULTS, drop_caches_verified, scratch_dir  # noqa: E402

GB = 1e9


# -- the state ------------------------------------------------------------------------------------
def gpt_state(layers: int, dim: int, vocab: int, ctx: int) -> dict[str, Any]:
    """GPT-2-like parameters (fp32) + AdamW state (exp_avg, exp_avg_sq, step) + scheduler + RNG."""
    g = torch.Generator().manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    model: dict[str, torch.Tensor] = {"wte.weight": rnd(vocab, dim), "wpe.weight": rnd(ctx, dim)}
    for i in range(layers):
        p = f"h.{i}."
        model |= {
            p + "ln_1.weight": rnd(dim),
            p + "ln_1.bias": rnd(dim),
            p + "attn.c_attn.weight": rnd(3 * dim, dim),
            p + "attn.c_attn.bias": rnd(3 * dim),
            p + "attn.c_proj.weight": rnd(dim, dim),
            p + "attn.c_proj.bias": rnd(dim),
            p + "ln_2.weight": rnd(dim),
            p + "ln_2.bias": rnd(dim),
            p + "mlp.c_fc.weight": rnd(4 * dim, dim),
            p + "mlp.c_fc.bias": rnd(4 * dim),
            p + "mlp.c_proj.weight": rnd(dim, 4 * dim),
            p + "mlp.c_proj.bias": rnd(dim),
        }
    model |= {"ln_f.weight": rnd(dim), "ln_f.bias": rnd(dim)}
    opt_state = {
        i: {"step": torch.tensor(100.0), "exp_avg": rnd(*t.shape), "exp_avg_sq": rnd(*t.shape).abs()}
        for i, t in enumerate(model.values())
    }
    groups = [
        {
            "lr": 3e-4,
            "betas": (0.9, 0.95),
            "eps": 1e-8,
            "weight_decay": 0.1,
            "amsgrad": False,
            "foreach": None,
            "maximize": False,
            "capturable": False,
            "differentiable": False,
            "fused": None,
            "params": list(range(len(model))),
        }
    ]
    return {
        "model": model,
        "optimizer": {"state": opt_state, "param_groups": groups},
        "scheduler": {"last_epoch": 100, "base_lrs": [3e-4], "_step_count": 101},
        "rng": torch.get_rng_state(),
        "step": 100,
    }


def nbytes_of(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


# -- helpers --------------------------------------------------------------------------------------
#: How many page-cache drops worked / failed in this run (a failed drop makes every load warm).
DROPS = {"ok": 0, "failed": 0}


def drop_caches(path: str) -> bool:
    """Drop the page cache (root only) and check with mincore that no file under ``path`` is still cached
    (bench/_common.drop_caches_verified); counted in DROPS. Returns whether the following read is cold."""
    files = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    ok = drop_caches_verified(*files)
    DROPS["ok" if ok else "failed"] += 1
    return ok


def loads_cold() -> bool:
    """True when every drop before a load worked (the loads really started from a dropped cache)."""
    return DROPS["failed"] == 0 and DROPS["ok"] > 0


def touch(obj: Any) -> int:
    """Read one byte of every 4 KiB page of every tensor, so that lazily mapped loads (safetensors'
    mmap) pay for their reads inside the timing like everyone else. Returns tensors seen."""
    if isinstance(obj, torch.Tensor):
        if obj.numel() and obj.dim():
            obj.reshape(-1).view(torch.uint8)[::4096].sum()
        return 1
    if isinstance(obj, dict):
        return sum(touch(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(touch(v) for v in obj)
    return 0


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str) -> None:
    for d, _, files in os.walk(root):
        for f in files:
            fsync_path(os.path.join(d, f))
        fsync_path(d)


def rm(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.unlink(path)


def machine(workdir: str) -> dict[str, str]:
    def sh(cmd: str) -> str:
        try:
            return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=10).stdout.strip()
        except Exception:
            return "?"

    cpu = sh("grep -m1 'model name' /proc/cpuinfo | cut -d: -f2")
    return {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "host": platform.node(),
        "kernel": platform.release(),
        "cpu": f"{os.cpu_count()} x {cpu}",
        "memory": sh("free -g | awk '/Mem:/{print $2\" GiB\"}'"),
        "filesystem": sh(f"df -T {workdir} | tail -1 | awk '{{print $1, $2}}'"),
        "torch": torch.__version__,
        "load average at the end (other jobs share these 2 cores)": sh("cut -d' ' -f1-3 /proc/loadavg"),
        "python": platform.python_version(),
    }


# -- the methods ----------------------------------------------------------------------------------
class Bench:
    def __init__(self, state: dict[str, Any], workdir: str) -> None:
        self.state = state
        self.dir = workdir
        self.flat, _ = flatten(state)  # what safetensors.save_file gets: the same tensors, flat
        self.nbytes = nbytes_of(self.flat)
        self.times: dict[str, list[float]] = defaultdict(list)
        self.cpu: dict[str, list[float]] = defaultdict(list)
        """Per method and rep: CPU seconds (user + system, every thread of this process)."""
        self.phases: dict[str, list[float]] = defaultdict(list)
        """The durable save's phases per rep (Checkpointer.statistics())."""
        self.handle = dsio.AsyncIOHandle(C.DEFAULT_IO)
        rm(self.p("ckpt"))  # steps of an earlier (killed) run: every run starts from an empty directory
        self.ckpt = C.Checkpointer(self.p("ckpt"))
        self.step = 0
        self.raw: torch.Tensor | None = None  # the Checkpointer's staging region, once it exists
        self.order: list[list[str]] = []
        """The methods in the order each rep ran them (`rep_order`)."""
        self.resident: torch.Tensor | None = None
        """The raw read's destination for the in-place load's ceiling: page-aligned 4 KiB-page memory
        faulted in once (like a state's tensors), reused every rep."""
        self.held: Any = None
        """What the last load returned (or read into), kept until its time and CPU were recorded: no
        method's clock includes freeing gigabytes of memory (unmapping 2.84 GiB of 4 KiB pages took
        0.3-0.5 s under load), which a load's caller never pays (it keeps the state)."""

    def p(self, name: str) -> str:
        return os.path.join(self.dir, name)

    # saves ---------------------------------------------------------------------------------------
    async def raw_write(self) -> float:
        path = self.p("raw.bin")
        rm(path)
        if self.raw is None:  # memory is shared with other jobs here: reuse the staged bytes
            view = self.ckpt._staging._view
            assert view is not None and view.numel() >= self.nbytes, "run a Checkpointer save first"
            self.raw = view[: self.nbytes]
        t = time.perf_counter()
        await self.handle.pwrite(self.raw, path, fsync=True)
        fsync_path(self.dir)
        return time.perf_counter() - t

    async def dsio_checkpointer(self) -> float:
        """Checkpointer.save: blocked time (until ``save()`` returned) and the time until the state
        may change again (``wait_staged()``) recorded separately; returns the durable time."""
        self.step += 1
        t = time.perf_counter()
        task = await self.ckpt.save(self.step, self.state)
        self.times["dsio async save: blocked"].append(time.perf_counter() - t)
        await self.ckpt.wait_staged()
        self.times["dsio async save: until staged"].append(time.perf_counter() - t)
        await task
        total = time.perf_counter() - t
        rm(os.path.join(self.ckpt.directory, f"step-{self.step - 1:09d}"))
        return total

    async def dsio_save_file(self) -> float:
        path = self.p("dsio.safetensors")
        rm(path)
        t = time.perf_counter()
        await C.save(self.state, path, handle=self.handle)
        fsync_path(self.dir)
        return time.perf_counter() - t

    async def torch_save(self) -> float:
        path = self.p("torch.pt")
        rm(path)
        t = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(self.state, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_path(self.dir)
        return time.perf_counter() - t

    async def safetensors_save(self) -> float:
        import safetensors.torch as st

        path = self.p("st.safetensors")
        rm(path)
        t = time.perf_counter()
        st.save_file(self.flat, path)
        fsync_path(path)
        fsync_path(self.dir)
        return time.perf_counter() - t

    async def dcp_save(self) -> float:
        import torch.distributed.checkpoint as dcp

        path = self.p("dcp")
        rm(path)
        t = time.perf_counter()
        dcp.save(self.state, checkpoint_id=path)  # FileSystemWriter, sync_files=True
        fsync_path(self.dir)
        return time.perf_counter() - t

    async def dcp_async_save(self) -> float:
        import torch.distributed.checkpoint as dcp

        path = self.p("dcp_async")
        rm(path)
        t = time.perf_counter()
        fut = dcp.async_save(self.state, checkpoint_id=path)
        self.times["DCP async_save: blocked"].append(time.perf_counter() - t)
        fut.result()
        fsync_path(self.dir)
        return time.perf_counter() - t

    async def dcp_dsio_save(self) -> float:
        import torch.distributed.checkpoint as dcp

        path = self.p("dcp_dsio")
        rm(path)
        t = time.perf_counter()
        dcp.save(self.state, storage_writer=C.DsioStorageWriter(path))
        fsync_path(self.dir)
        return time.perf_counter() - t

    # loads (cold cache) ----------------------------------------------------------------------------
    async def raw_read(self) -> float:
        path = self.p("raw.bin")
        drop_caches(path)
        t = time.perf_counter()
        base = torch.empty(self.nbytes + 4096, dtype=torch.uint8)  # fresh memory, as a load needs
        s = (-base.data_ptr()) % 4096
        await self.handle.pread(base[s : s + self.nbytes], path)
        touch(base)
        self.held = base
        return time.perf_counter() - t

    def make_resident(self) -> None:
        """Allocate and fault in `resident` (at warm-up: neither timed nor counted as CPU)."""
        base = torch.zeros(self.nbytes + 4096, dtype=torch.uint8)  # faulted in, as a state's tensors are
        s = (-base.data_ptr()) % 4096
        self.resident = base[s : s + self.nbytes]

    async def raw_read_resident(self) -> float:
        path = self.p("raw.bin")
        if self.resident is None:
            self.make_resident()
        drop_caches(path)
        t = time.perf_counter()
        await self.handle.pread(self.resident, path)
        touch(self.resident)
        return time.perf_counter() - t

    async def dsio_load_into(self) -> float:
        """``load(into=state)``: the file's tensors read into the state's own (same values: it was
        saved from them), as a resume loads; no fresh memory."""
        drop_caches(self.p("ckpt"))
        t = time.perf_counter()
        self.held = await self.ckpt.load(self.step, into=self.state)
        touch(self.held)
        return time.perf_counter() - t

    async def dsio_load(self) -> float:
        drop_caches(self.p("ckpt"))
        t = time.perf_counter()
        self.held = await self.ckpt.load(self.step)
        touch(self.held)
        return time.perf_counter() - t

    async def dsio_load_sums_after(self) -> float:
        """A/B: the load with its checksums computed after each read (halves of the span, the
        next read overlapping), as before the engine's copier computed them as the bytes landed."""
        drop_caches(self.p("ckpt"))
        with switched(engine_sums=False):
            t = time.perf_counter()
            self.held = await self.ckpt.load(self.step)
            touch(self.held)
            return time.perf_counter() - t

    async def dsio_load_noverify(self) -> float:
        drop_caches(self.p("ckpt"))
        t = time.perf_counter()
        self.held = await self.ckpt.load(self.step, verify=False)
        touch(self.held)
        return time.perf_counter() - t

    async def torch_load(self) -> float:
        drop_caches(self.p("torch.pt"))
        t = time.perf_counter()
        self.held = torch.load(self.p("torch.pt"), weights_only=True)
        touch(self.held)
        return time.perf_counter() - t

    async def safetensors_load(self) -> float:
        import safetensors.torch as st

        drop_caches(self.p("st.safetensors"))
        t = time.perf_counter()
        self.held = st.load_file(self.p("st.safetensors"))
        touch(self.held)
        return time.perf_counter() - t

    def _target(self) -> dict[str, Any]:
        # DCP loads in place; loading into the state itself (same values) saves 3 GiB of memory.
        return self.state

    async def dcp_load(self) -> float:
        import torch.distributed.checkpoint as dcp

        target = self._target()
        drop_caches(self.p("dcp"))
        t = time.perf_counter()
        dcp.load(target, checkpoint_id=self.p("dcp"))
        touch(target)
        return time.perf_counter() - t

    async def dcp_dsio_load(self) -> float:
        import torch.distributed.checkpoint as dcp

        target = self._target()
        drop_caches(self.p("dcp_dsio"))
        t = time.perf_counter()
        dcp.load(target, storage_reader=C.DsioStorageReader(self.p("dcp_dsio")))
        touch(target)
        return time.perf_counter() - t


#: The in-place load and its ceiling: both read into memory that is already faulted in.
RAW_RESIDENT = "dsio raw read into resident memory (ceiling of an in-place load)"
INTO = "dsio Checkpointer load into the state (into=, in place, crc32c verified)"

SAVES: list[tuple[str, str]] = [
    ("dsio raw write (new file, ceiling)", "raw_write"),
    ("dsio Checkpointer save (durable)", "dsio_checkpointer"),
    ("dsio.checkpoint.save (one-shot, streams from the tensors)", "dsio_save_file"),
    ("torch.save + fsync", "torch_save"),
    ("safetensors save_file + fsync", "safetensors_save"),
    ("DCP save (FileSystemWriter)", "dcp_save"),
    ("DCP async_save (FileSystemWriter)", "dcp_async_save"),
    ("DCP save (DsioStorageWriter)", "dcp_dsio_save"),
]
LOADS: list[tuple[str, str]] = [
    ("dsio raw read (ceiling)", "raw_read"),
    ("dsio Checkpointer load (crc32c verified)", "dsio_load"),
    ("dsio Checkpointer load (verify=False)", "dsio_load_noverify"),
    ("dsio Checkpointer load, A/B: checksums after each read (engine_sums=False)", "dsio_load_sums_after"),
    (RAW_RESIDENT, "raw_read_resident"),
    (INTO, "dsio_load_into"),
    ("torch.load", "torch_load"),
    ("safetensors load_file", "safetensors_load"),
    ("DCP load (FileSystemReader)", "dcp_load"),
    ("DCP load (DsioStorageReader)", "dcp_dsio_load"),
]


#: Each ceiling and the dsio method measured against it: they swap places every other rep (ABBA), so
#: that neither always runs right after the other (a 2.84 GiB write just before a write, or a read
#: just before a read, is not the same disk).
PAIRS: list[tuple[str, str]] = [
    ("dsio raw write (new file, ceiling)", "dsio Checkpointer save (durable)"),
    ("dsio raw read (ceiling)", "dsio Checkpointer load (crc32c verified)"),
    (RAW_RESIDENT, INTO),
]


def rep_order(steps: list[tuple[str, Callable]], rep: int) -> list[tuple[str, Callable]]:
    """The methods of rep ``rep`` in the order they run: ``steps``, with each pair of `PAIRS`
    swapped on odd reps."""
    out = list(steps)
    if rep % 2:
        names = [n for n, _ in out]
        for a, b in PAIRS:
            if a in names and b in names:
                i, j = names.index(a), names.index(b)
                out[i], out[j] = out[j], out[i]
                names[i], names[j] = names[j], names[i]
    return out


def paired_ratios(T: dict[str, list[float]]) -> dict[str, list[float]]:
    """Per rep, ceiling seconds / dsio seconds of each pair (the two ran side by side in that rep)."""
    return {
        f"{b} vs {a}": [x / y for x, y in zip(T[a], T[b], strict=False)]
        for a, b in PAIRS
        if T.get(a) and T.get(b)
    }


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def core_rates(nbytes: int = 256 << 20, reps: int = 3) -> dict[str, float]:
    """What one core does per second (best of ``reps``), the resources a save and a load need beside
    the disk: crc32c (the checksums), memcpy into locked memory (the staging copy), and the first
    touch of fresh memory (page faults + zeroing: what a load into new tensors, and the raw read
    into fresh memory, pay)."""
    from dsio._memory import aligned_buffer, memcpy

    mem = aligned_buffer(nbytes)
    dst = torch.frombuffer(mem, dtype=torch.uint8)
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    best = {"crc32c": float("inf"), "memcpy": float("inf"), "fresh memory first touch": float("inf")}
    for _ in range(reps):
        t = time.perf_counter()
        crc_of(src.data_ptr(), nbytes)
        best["crc32c"] = min(best["crc32c"], time.perf_counter() - t)
        t = time.perf_counter()
        memcpy(dst.data_ptr(), src.data_ptr(), nbytes)
        best["memcpy"] = min(best["memcpy"], time.perf_counter() - t)
        t = time.perf_counter()
        fresh = torch.empty(nbytes, dtype=torch.uint8)
        fresh[::4096] = 1  # one write per page: each page faulted in and zeroed by the kernel
        best["fresh memory first touch"] = min(best["fresh memory first touch"], time.perf_counter() - t)
        del fresh
    del dst, mem
    return {k: nbytes / v / GB for k, v in best.items()}


def crc_rate(flat: dict[str, torch.Tensor]) -> float:
    t = time.perf_counter()
    n = 0
    for v in flat.values():
        v = v.contiguous()
        crc_of(v.data_ptr(), v.numel() * v.element_size())
        n += v.numel() * v.element_size()
    return n / (time.perf_counter() - t)


# -- report ---------------------------------------------------------------------------------------
def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def row(name: str, xs: list[float], nbytes: int) -> str:
    if not xs:
        return f"| {name} | - | - |"
    m, lo, hi = med(xs), min(xs), max(xs)
    return f"| {name} | {m:.2f} ({lo:.2f}-{hi:.2f}) | {nbytes / m / GB:.2f} ({nbytes / hi / GB:.2f}-{nbytes / lo / GB:.2f}) |"


DURABLE = "dsio Checkpointer save (durable)"
LOAD = "dsio Checkpointer load (crc32c verified)"


def _ratio(T: dict[str, list[float]], a: str, b: str) -> float:
    """How many times faster ``a`` is than ``b`` (ratio of median seconds)."""
    return med(T[b]) / med(T[a]) if T.get(a) and T.get(b) else float("nan")


def targets(T: dict[str, list[float]]) -> list[dict[str, Any]]:
    """The issue's targets: [{target, value, unit ("x" or "%"), met}], computed from the medians."""
    blocked = med(T["dsio async save: blocked"]) / med(T[DURABLE]) * 100 if T.get(DURABLE) else float("nan")
    verify = (
        (med(T[LOAD]) / med(T["dsio Checkpointer load (verify=False)"]) - 1) * 100
        if T.get(LOAD)
        else float("nan")
    )
    rows = [
        (
            "durable save >= 0.95x dsio raw new-file write",
            _ratio(T, DURABLE, "dsio raw write (new file, ceiling)"),
            "x",
            0.95,
            operator.ge,
        ),
        (
            "durable save >= 4x safetensors + fsync",
            _ratio(T, DURABLE, "safetensors save_file + fsync"),
            "x",
            4,
            operator.ge,
        ),
        ("async save blocked <= 5% of a synchronous save", blocked, "%", 5, operator.le),
        ("load >= 0.95x dsio raw read", _ratio(T, LOAD, "dsio raw read (ceiling)"), "x", 0.95, operator.ge),
        ("load >= safetensors load_file", _ratio(T, LOAD, "safetensors load_file"), "x", 1, operator.ge),
        ("checksum verification < 10% of load time", verify, "%", 10, operator.lt),
        (
            "in-place load (into=) >= 0.95x dsio raw read into resident memory",
            _ratio(T, INTO, RAW_RESIDENT),
            "x",
            0.95,
            operator.ge,
        ),
    ]
    return [
        {"target": name, "value": v, "unit": unit, "met": bool(met(v, bound))}
        for name, v, unit, bound, met in rows
    ]


def other_ratios(T: dict[str, list[float]]) -> dict[str, float]:
    return {
        "durable save vs torch.save + fsync": _ratio(T, DURABLE, "torch.save + fsync"),
        "durable save vs DCP save": _ratio(T, DURABLE, "DCP save (FileSystemWriter)"),
        "load vs torch.load": _ratio(T, LOAD, "torch.load"),
        "load vs DCP load": _ratio(T, LOAD, "DCP load (FileSystemReader)"),
        "in-place load (into=) vs the raw read into fresh memory": _ratio(T, INTO, "dsio raw read (ceiling)"),
        "in-place load (into=) vs DCP load (both in place)": _ratio(T, INTO, "DCP load (FileSystemReader)"),
    }


def to_json(
    b: Bench, mach: dict[str, str], reps: int, crc: float, args: argparse.Namespace, cores: dict[str, float]
) -> dict[str, Any]:
    """The run as data (the schema scripts/readme_numbers.py reads): every rep, medians, targets."""
    T, n = b.times, b.nbytes
    rows: dict[str, dict[str, Any]] = {}
    shown = {  # the report's rows: the blocked times are shown under their save
        "dsio Checkpointer save: time training is blocked": "dsio async save: blocked",
        "dsio Checkpointer save: until the state may change (wait_staged)": "dsio async save: until staged",
        "DCP async_save: time training is blocked": "DCP async_save: blocked",
    }
    names = [(name, name, "save") for name, _ in SAVES] + [(k, v, "save") for k, v in shown.items()]
    names += [(name, name, "load") for name, _ in LOADS]
    for row_name, key, section in names:
        xs = T.get(key) or []
        if xs:
            m, lo, hi = med(xs), min(xs), max(xs)
            rows[row_name] = {
                "seconds_median": m, "seconds_min": lo, "seconds_max": hi,
                "gbps_median": n / m / GB, "gbps_min": n / hi / GB, "gbps_max": n / lo / GB, "section": section,
            }  # fmt: skip
    return {
        "kind": "checkpoint",
        "label": args.label,
        "meta": mach,
        "state": {
            "layers": args.layers,
            "dim": args.dim,
            "vocab": args.vocab,
            "tensors": len(b.flat),
            "gib": round(n / 2**30, 2),
            "nbytes": n,
        },  # fmt: skip
        "reps": reps,
        "page_cache_dropped": loads_cold(),
        "crc32c_gbps": crc / GB,
        "crc32c_path": crc_path(),
        "core_gbps": cores,
        "cpu_seconds": dict(b.cpu),
        "save_phases_seconds": dict(b.phases),
        "limits": limits(b, cores),
        "rows": rows,
        "seconds": dict(T),
        "targets": targets(T),
        "other_ratios": other_ratios(T),
        "paired_ratios": paired_ratios(T),
        "order": b.order,
    }


def limits(b: Bench, cores: dict[str, float]) -> dict[str, float]:
    """The rates each resource allows, GB/s, next to the disk's (the raw rows): staging needs a
    memcpy and a crc32c of every byte on ``copy_threads`` cores, a verified load a crc32c of every
    byte on 2 threads, and both a load and the raw read fault in fresh memory."""
    T, n = b.times, b.nbytes
    per_core_stage = 1 / (1 / cores["memcpy"] + 1 / cores["crc32c"])
    threads = min(b.ckpt.copy_threads, os.cpu_count() or 1)
    out = {
        "disk write (raw new-file write), GB/s": n / med(T["dsio raw write (new file, ceiling)"]) / GB
        if T.get("dsio raw write (new file, ceiling)")
        else float("nan"),
        "disk read (raw read), GB/s": n / med(T["dsio raw read (ceiling)"]) / GB
        if T.get("dsio raw read (ceiling)")
        else float("nan"),
        "staging (memcpy + crc32c) on one core, GB/s": per_core_stage,
        f"staging on the {threads} copier threads, GB/s": per_core_stage * threads,
        "crc32c on one core, GB/s": cores["crc32c"],
        "load checksums (crc32c) on 2 threads, GB/s": cores["crc32c"] * min(2, os.cpu_count() or 1),
        "fresh memory first touch on one core, GB/s": cores["fresh memory first touch"],
    }
    for name in (DURABLE, "dsio raw write (new file, ceiling)", LOAD, "dsio raw read (ceiling)"):
        if b.cpu.get(name):
            out[f"CPU seconds per GB: {name}"] = med(b.cpu[name]) / (n / GB)
    return out


def report(
    b: Bench, mach: dict[str, str], reps: int, crc: float, args: argparse.Namespace, cores: dict[str, float]
) -> str:
    T, n = b.times, b.nbytes
    lines = [
        f"# dsio.checkpoint benchmark, {mach['date']}",
        "",
        "Machine: " + ", ".join(f"{k} {v}" for k, v in mach.items() if k != "date"),
        "",
        f"State: GPT-like model (layers={args.layers}, dim={args.dim}, vocab={args.vocab}) + AdamW "
        f"(exp_avg, exp_avg_sq, step) + scheduler + RNG: {len(b.flat)} tensors, {n / 2**30:.2f} GiB. "
        f"{reps} reps, methods interleaved rep by rep; median (min-max). Every save writes a new file "
        "and is fsynced (data + directory); "
        + (
            "every load starts after `sync; echo 3 > /proc/sys/vm/drop_caches` "
            "(the virtio disk sits on the host page cache, which cannot be dropped from here)"
            if loads_cold()
            else f"**the page cache could not be dropped ({DROPS['failed']} of "
            f"{DROPS['failed'] + DROPS['ok']} drops refused (not root) or left the file cached (mincore)), so "
            "the loads are WARM reads**"
        )
        + " and ends after one byte of every 4 KiB page of every loaded tensor was read (safetensors maps the file "
        "lazily; this makes it pay for its reads like the others); what a load returned is freed after its time "
        "and CPU were taken, for every method (the raw read's buffer too). dsio raw write/read: one "
        "`pwrite`/`pread` of the same byte count from/into page-aligned memory (the read into freshly "
        "allocated memory, as a load needs). `dsio Checkpointer save` = `await (await ckpt.save())`; "
        "its blocked time is until `save()` returned. `dsio.checkpoint.save` is the one-shot function "
        "(streams from the tensors). `save()` returns before the state is copied; the caller changes nothing until "
        "`await ckpt.wait_staged()` returns (the 'until the state may change' row: a training loop overlaps it "
        "with its next forward and backward). DCP loads go into the preallocated state (DCP loads in place), "
        "as does dsio's `load(into=state)`, whose ceiling is the raw read into page-aligned memory already "
        "faulted in (reused every rep). "
        "The raw write writes the Checkpointer's staging region (the file's bytes). Each raw ceiling and the "
        "dsio method it bounds swap places every other rep (ABBA: raw write / Checkpointer save, raw read / "
        "Checkpointer load), so neither always runs right after the other.",
        "",
        f"crc32c ({crc_path()} path) over the state: {crc / GB:.1f} GB/s on one core; on 256 MiB, best of 3: "
        + ", ".join(f"{k} {v:.1f} GB/s" for k, v in cores.items())
        + " (one core each).",
        "",
        "## Saves",
        "",
        "| method | seconds | GB/s |",
        "| --- | --- | --- |",
    ]
    for name, _ in SAVES:
        lines.append(row(name, T[name], n))
        if name.startswith("dsio Checkpointer"):
            lines.append(
                row("dsio Checkpointer save: time training is blocked", T["dsio async save: blocked"], n)
            )
            lines.append(
                row(
                    "dsio Checkpointer save: until the state may change (wait_staged)",
                    T["dsio async save: until staged"],
                    n,
                )
            )
        if name.startswith("DCP async_save"):
            lines.append(row("DCP async_save: time training is blocked", T["DCP async_save: blocked"], n))
    cache = "cold page cache" if loads_cold() else "WARM page cache: it could not be dropped"
    lines += ["", f"## Loads ({cache})", "", "| method | seconds | GB/s |", "| --- | --- | --- |"]
    for name, _ in LOADS:
        lines.append(row(name, T[name], n))

    lines += [
        "",
        "## Against the targets (ratios of medians, same run)",
        "",
        "| target | measured | met |",
        "| --- | --- | --- |",
    ]
    for t in targets(T):
        shown = f"{t['value']:.2f}x" if t["unit"] == "x" else f"{t['value']:.1f}%"
        lines.append(f"| {t['target']} | {shown} | {'yes' if t['met'] else 'no'} |")
    o = other_ratios(T)
    lines += [
        "",
        f"Other ratios: dsio durable save vs torch.save + fsync {o['durable save vs torch.save + fsync']:.2f}x, "
        f"vs DCP save {o['durable save vs DCP save']:.2f}x; dsio load vs torch.load {o['load vs torch.load']:.2f}x, "
        f"vs DCP load {o['load vs DCP load']:.2f}x.",
        "",
        "Per-rep ratios of each pair (ceiling seconds / dsio seconds, the two side by side in that rep): "
        + "; ".join(f"{k}: {', '.join(f'{x:.2f}' for x in v)}" for k, v in paired_ratios(T).items())
        + ".",
        "",
        "## Where the time goes",
        "",
        "CPU seconds (user + system, all threads of the process) per operation, medians; on a machine shared "
        "with other jobs, CPU a method needs beyond the raw I/O's is wall time it waits for a core.",
        "",
        "| method | wall s | CPU s |",
        "| --- | --- | --- |",
    ]
    for name in [n for n, _ in SAVES] + [n for n, _ in LOADS]:
        if T.get(name) and b.cpu.get(name):
            lines.append(f"| {name} | {med(T[name]):.2f} | {med(b.cpu[name]):.2f} |")
    lines += ["", "Durable save phases (Checkpointer.statistics(), medians): "]
    lines[-1] += "; ".join(f"{k} {med(v):.3f} s" for k, v in b.phases.items()) + "."
    lines += ["", "Rates each resource allows (GB/s; the disk's from the raw rows):", ""]
    for k, v in limits(b, cores).items():
        lines.append(f"- {k}: {v:.2f}")
    lines += [
        "",
        "Raw per-rep seconds:",
        "",
    ]
    for k, v in T.items():
        lines.append(f"- {k}: {', '.join(f'{x:.2f}' for x in v)}")
    return "\n".join(lines) + "\n"


def plot(b: Bench, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    for ax, group, title in ((axes[0], SAVES, "durable save"), (axes[1], LOADS, "load (cold cache)")):
        names = [n for n, _ in group if b.times[n]]
        rates = [b.nbytes / med(b.times[n]) / GB for n in names]
        ax.barh(names, rates, color=["#2a7" if n.startswith("dsio") else "#889" for n in names])
        ax.invert_yaxis()
        ax.set_xlabel("GB/s (median)")
        ax.set_title(f"{title}, {b.nbytes / 2**30:.2f} GiB state")
        for y, v in enumerate(rates):
            ax.text(v, y, f" {v:.2f}", va="center", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


async def main_async(args: argparse.Namespace) -> None:
    warnings.filterwarnings("ignore")
    os.makedirs(args.dir, exist_ok=True)
    print("building the state...", file=sys.stderr)
    state = gpt_state(args.layers, args.dim, args.vocab, 1024)
    b = Bench(state, args.dir)
    print(f"{len(b.flat)} tensors, {b.nbytes / 2**30:.2f} GiB", file=sys.stderr)
    crc = crc_rate(b.flat)
    cores = core_rates()
    saves = [(n, getattr(b, m)) for n, m in SAVES if args.methods is None or m in args.methods]
    loads = [(n, getattr(b, m)) for n, m in LOADS if args.methods is None or m in args.methods]
    # Warm-up (not recorded): allocate the Checkpointer's staging region, build the raw file.
    await b.dsio_checkpointer()
    await b.raw_write()
    if any(fn == b.raw_read_resident for _, fn in loads):
        b.make_resident()
    b.times.clear()
    steps: list[tuple[str, Callable]] = saves + loads
    with tqdm(total=args.reps * len(steps), desc="checkpoint bench", unit="op") as bar:
        for rep in range(args.reps):
            order = rep_order(steps, rep)
            b.order.append([name for name, _ in order])
            for name, fn in order:
                bar.set_postfix_str(f"rep {rep + 1}: {name[:40]}")
                cpu0 = cpu_seconds()
                b.times[name].append(await fn())
                b.cpu[name].append(cpu_seconds() - cpu0)
                b.held = None  # freed outside every method's time and CPU (`Bench.held`)
                if fn == b.dsio_checkpointer:  # where the durable save's time went
                    st = b.ckpt.statistics()
                    b.phases["staging (copy + crc32c, overlapped with the writes)"].append(
                        st.last_staging_seconds
                    )
                    b.phases["after staging: last writes, header, fsync, commit"].append(
                        st.last_write_seconds
                    )
                bar.update()
    b.ckpt.close()
    b.handle.close()
    mach = machine(args.dir)
    text = report(b, mach, args.reps, crc, args, cores)
    print(text)
    if args.write:
        os.makedirs(args.results, exist_ok=True)
        name = f"checkpoint-{dt.datetime.now(dt.timezone.utc):%Y-%m-%d}" + (
            f"-{args.label}" if args.label else ""
        )
        stem = os.path.join(args.results, name)
        with open(stem + ".md", "w") as f:
            f.write(text + f"\n![results]({name}.png)\n")
        with open(stem + ".json", "w") as f:
            json.dump(to_json(b, mach, args.reps, crc, args, cores), f, indent=1)
        plot(b, stem + ".png")
        print(f"wrote {stem}.json, .md and .png", file=sys.stderr)
    if not args.keep:
        shutil.rmtree(args.dir, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--dir",
        default=os.path.join(scratch_dir(), "checkpoint"),
        help="working directory, on the disk to measure (default: $DSIO_BENCH_DIR/checkpoint, else "
        "<checkout>/.bench-tmp/checkpoint)",
    )
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--methods", nargs="*", default=None, help="method names to run (default: all)")
    ap.add_argument("--no-write", dest="write", action="store_false", help="do not write bench/results")
    ap.add_argument("--keep", action="store_true", help="keep the working directory")
    ap.add_argument(
        "--label",
        default="",
        help="suffix of the result files (checkpoint-<date>-<label>.json), e.g. 'quiet' or 'under-load': "
        "a re-run never overwrites another run's results unless asked to",
    )
    ap.add_argument(
        "--results",
        default=RESULTS,
        help="where the .json/.md/.png go (default: $DSIO_BENCH_RESULTS, else bench/results)",
    )
    ap.add_argument(
        "--quick", action="store_true", help="seconds (make bench): 2 layers of 256, vocab 1024, 1 rep"
    )
    args = ap.parse_args()
    if args.quick:
        args.layers, args.dim, args.vocab, args.reps, args.label = 2, 256, 1024, 1, args.label or "quick"
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
