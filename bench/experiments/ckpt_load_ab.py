"""Where a checkpoint load's time goes against dsio's raw read (issue 31: load >= 0.95x the raw read).

One file written by ``Checkpointer`` (bench/checkpoint.py's GPT-like state) and one raw file of the
same byte count; then, rep by rep in rotating order, each variant reads from a dropped page cache
and touches one byte per page of what it read (as bench/checkpoint.py's loads do). Variants:

- ``raw``: bench/checkpoint.py's ceiling, one ``handle.pread`` of the raw file into ``torch.empty``
- ``raw reused``: the same read into one already-faulted aligned buffer (no first-touch cost)
- ``load``, ``load noverify``: ``Checkpointer.load`` as it is (verify on / off)
- ``span <alloc> <populate>``: the data section read as `dsio.checkpoint._read` does (pieces in
  flight, each crc32c'd on a worker thread as it lands, ``--no-crc`` off), into memory from
  ``torch.empty`` (``empty``) or an unlocked ``aligned_buffer(hugepage=True)`` (``thp``), with
  the destination populated ahead of the reads on a thread (``pop``: MADV_POPULATE_WRITE piece by
  piece, each read waiting until its piece is populated) or not (``nopop``)

    .venv/bin/python bench/experiments/ckpt_load_ab.py --reps 4            # 2.84 GiB state
    .venv/bin/python bench/experiments/ckpt_load_ab.py --layers 4 --reps 2 # smaller

Prints per-variant min / median seconds and each one's ratio to ``raw`` within each rep.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import ctypes
import os
import resource
import shutil
import statistics
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

import dsio  # noqa: E402
import dsio.checkpoint as C  # noqa: E402
from bench._common import drop_caches_verified, scratch_dir  # noqa: E402
from bench.checkpoint import gpt_state, touch  # noqa: E402
from dsio._memory import aligned_buffer  # noqa: E402
from dsio.checkpoint._integrity import crc_of  # noqa: E402
from dsio.checkpoint._read import read_file, read_header  # noqa: E402

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
MADV_POPULATE_WRITE = 23
POP_THREADS = 1


def schedule(n: int, piece: int) -> list[tuple[int, int]]:
    """Pieces of ``piece`` bytes; a negative ``piece`` -r: geometric, each piece (1 - 1/r) of what
    is left, down to 32 MiB (the last piece the rest)."""
    if piece > 0:
        return [(a, min(a + piece, n)) for a in range(0, n, piece)]
    r, low, out, a = -piece, 32 << 20, [], 0
    while n - a > 2 * low:
        k = max(low, (n - a) * (r - 1) // r // (1 << 20) * (1 << 20))
        out.append((a, a + k))
        a += k
    out.append((a, n))
    return out


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def alloc(kind: str, nbytes: int) -> tuple[torch.Tensor, object]:
    if kind == "empty":
        base = torch.empty(nbytes + 4096, dtype=torch.uint8)
        s = (-base.data_ptr()) % 4096
        return base[s : s + nbytes], base
    mem = aligned_buffer(nbytes, lock=False, hugepage=True)
    return torch.frombuffer(mem, dtype=torch.uint8)[:nbytes], mem


async def span_read(
    handle: dsio.AsyncIOHandle,
    path: str,
    *,
    kind: str,
    populate: bool,
    crc: bool,
    piece: int,
    in_flight: int,
) -> torch.Tensor:
    async with handle.open(path, "r") as f:
        size = f.size
        header = await read_header(f, path, size)
        lo = header.data_start & ~4095
        n = size - lo
        io, keep = alloc(kind, n)
        bounds = schedule(n, piece)
        ready = [threading.Event() for _ in bounds]
        loop = asyncio.get_running_loop()
        stop = threading.Event()

        claim = iter(range(len(bounds)))
        claim_lock = threading.Lock()

        def populator() -> None:
            base = io.data_ptr()
            while not stop.is_set():
                with claim_lock:
                    i = next(claim, None)
                if i is None:
                    return
                a, b = bounds[i]
                _libc.madvise(base + a, b - a, MADV_POPULATE_WRITE)
                ready[i].set()

        ths = []
        if populate:
            ths = [threading.Thread(target=populator, daemon=True) for _ in range(POP_THREADS)]
            for th in ths:
                th.start()
        ex = concurrent.futures.ThreadPoolExecutor(2) if crc else None
        gate = asyncio.Semaphore(in_flight)

        async def one(i: int) -> None:
            a, b = bounds[i]
            async with gate:
                if populate and not ready[i].is_set():
                    await loop.run_in_executor(None, ready[i].wait)
                await f.pread(io[a:b], lo + a)
            if ex is not None:
                step = 32 << 20
                await asyncio.gather(
                    *(
                        loop.run_in_executor(ex, crc_of, io.data_ptr() + c, min(c + step, b) - c)
                        for c in range(a, b, step)
                    )
                )

        try:
            await asyncio.gather(*(one(i) for i in range(len(bounds))))
        finally:
            stop.set()
            for th in ths:
                th.join()
            if ex is not None:
                ex.shutdown()
        del keep
        return io


async def main_async(args: argparse.Namespace) -> None:
    d = os.path.join(args.dir, "ckpt_load_ab")
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    state = gpt_state(args.layers, 1024, 50304, 1024)
    ck = C.Checkpointer(os.path.join(d, "ckpt"))
    handle = dsio.AsyncIOHandle(C.DEFAULT_IO)
    await (await ck.save(1, state))
    ckfile = os.path.join(d, "ckpt", "step-000000001", "rank-00000.safetensors")
    nbytes = os.path.getsize(ckfile)
    raw = os.path.join(d, "raw.bin")
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    await handle.pwrite(src, raw, fsync=True)
    del src, state
    reused, _reused_mem = alloc("thp", nbytes)
    reused.fill_(0)
    reused4, _reused4_mem = alloc("empty", nbytes)
    reused4.fill_(0)
    print(f"{nbytes / 2**30:.2f} GiB", file=sys.stderr)

    async def raw_read() -> object:
        base = torch.empty(nbytes + 4096, dtype=torch.uint8)
        s = (-base.data_ptr()) % 4096
        await handle.pread(base[s : s + nbytes], raw)
        return base

    async def raw_reused() -> object:
        await handle.pread(reused[: nbytes & ~4095], raw)
        return reused

    async def raw_reused4() -> object:
        await handle.pread(reused4[: nbytes & ~4095], raw)
        return reused4

    variants: dict[str, tuple[str, Callable[[], Awaitable[object]]]] = {
        "raw": (raw, raw_read),
        "raw reused": (raw, raw_reused),
        "raw 4k reused": (raw, raw_reused4),
        "load": (ckfile, lambda: ck.load(1)),
        "load noverify": (ckfile, lambda: ck.load(1, verify=False)),
        "read_file": (ckfile, lambda: read_file(handle, ckfile)),
        "read_file noverify": (ckfile, lambda: read_file(handle, ckfile, verify=False)),
    }
    for kind in ("empty", "thp"):
        for pop in (False, True):
            for piece in args.piece:
                for fl in args.in_flight:
                    name = f"span {kind} {'pop' if pop else 'nopop'} {piece}x{fl}"

                    def fn(
                        kind: str = kind, pop: bool = pop, piece: int = piece, fl: int = fl
                    ) -> Awaitable[object]:
                        return span_read(
                            handle,
                            ckfile,
                            kind=kind,
                            populate=pop,
                            crc=not args.no_crc,
                            piece=piece << 20 if piece > 0 else piece,
                            in_flight=fl,
                        )

                    variants[name] = (ckfile, fn)
    if args.only:
        variants = {
            k: v for k, v in variants.items() if k == "raw" or any(k.startswith(o) for o in args.only)
        }
    names = list(variants)
    T: dict[str, list[float]] = defaultdict(list)
    CPU: dict[str, list[float]] = defaultdict(list)
    for rep in range(args.reps):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            path, fn = variants[name]
            if not drop_caches_verified(path):
                print("page cache not dropped", file=sys.stderr)
            t, c = time.perf_counter(), cpu_seconds()
            out = await fn()
            touch(out)
            T[name].append(time.perf_counter() - t)
            CPU[name].append(cpu_seconds() - c)
            del out
        print(f"rep {rep}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in T.items()), file=sys.stderr)
    print(f"load average {os.getloadavg()[0]:.1f}; {nbytes / 2**30:.2f} GiB; per-rep ratio raw/variant")
    print("| variant | min s | median s | CPU s (median) | ratio raw/variant per rep (median) |")
    print("| --- | --- | --- | --- | --- |")
    for k, v in T.items():
        r = [a / b for a, b in zip(T["raw"], v, strict=True)]
        print(
            f"| {k} | {min(v):.3f} | {statistics.median(v):.3f} | {statistics.median(CPU[k]):.2f} | "
            f"{', '.join(f'{x:.2f}' for x in r)} ({statistics.median(r):.2f}) |"
        )
    ck.close()
    handle.close()
    shutil.rmtree(d, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=scratch_dir())
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--piece", type=int, nargs="+", default=[32], help="MiB per piece (several: one variant each)"
    )
    ap.add_argument("--in-flight", type=int, nargs="+", default=[2])
    ap.add_argument("--no-crc", action="store_true")
    ap.add_argument("--pop-threads", type=int, default=1)
    ap.add_argument("--only", nargs="*", default=None, help="variant names (raw always runs)")
    args = ap.parse_args()
    global POP_THREADS
    POP_THREADS = args.pop_threads
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
