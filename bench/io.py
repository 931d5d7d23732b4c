"""dsio I/O benchmark against fio and DeepSpeed's DeepNVMe, interleaved rep by rep.

    python bench/io.py [--dir /work/tmp-bench] [--size-gib 1] [--reps 5]

Per rep, every method runs once in turn (this disk drifts up to 3x within minutes, see
shared/ANCHORS.md), so medians and ratios compare methods measured side by side:
  - 1 GiB sequential: write to a new file, overwrite, read (page cache dropped before reads),
    for each dsio backend with a locked (4096-aligned, mlock'ed) buffer and with an ordinary
    torch.randn tensor; fio (libaio and io_uring, 1 MiB, QD32, O_DIRECT, end_fsync) and
    DeepSpeed's aio_handle (defaults: 1 MiB, QD128, 1 thread; locked and plain buffers).
  - small ops: 2,000 concurrent 64 KiB and 1 MiB writes and reads at distinct offsets of one
    file: dsio through an open file and through paths, fio QD1/QD32, DeepSpeed async_* + wait().
Writes are timed to completion of the data transfer; "+fsync" columns add a durable flush.
Results: bench/results/<date>-<host>-io.md (+ .json, .png).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dsio  # noqa: E402
from bench._common import drop_caches, fmt, fs_of, machine, result_path, summarize  # noqa: E402
from bench.baselines import fio  # noqa: E402

DS_PY = os.environ.get("DSIO_DEEPSPEED_PYTHON", "/work/ds-venv/bin/python")
DS_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "baselines", "deepspeed_io.py")

Results = dict[str, dict[str, list[float]]]  # method -> case -> values


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unlink(path: str) -> None:
    if os.path.exists(path):
        os.unlink(path)


# -- dsio --------------------------------------------------------------------------------------
class DsioRunner:
    """One open handle per configuration, reused across reps, on one event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, cfg: dsio.IOConfig) -> None:
        self.loop = loop
        self.h = dsio.AsyncIOHandle(cfg)

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def seq(self, buf: torch.Tensor, path: str, out: dict[str, list[float]]) -> None:
        n = buf.nbytes
        unlink(path)
        t0 = time.perf_counter()
        self.run(self.h.pwrite(buf, path))
        t1 = time.perf_counter()
        fsync_path(path)
        t2 = time.perf_counter()
        out["write_new"].append(n / (t1 - t0) / 1e9)
        out["write_new_fsync"].append(n / (t2 - t0) / 1e9)
        t0 = time.perf_counter()
        self.run(self.h.pwrite(buf, path, offset=0))  # in place: an overwrite of existing blocks
        out["overwrite"].append(n / (time.perf_counter() - t0) / 1e9)
        drop_caches()
        t0 = time.perf_counter()
        self.run(self.h.pread(buf, path))
        out["read"].append(n / (time.perf_counter() - t0) / 1e9)

    def ops(self, buf: torch.Tensor, size: int, count: int, path: str, out: dict[str, list[float]]) -> None:
        views = [buf[i * size : (i + 1) * size] for i in range(count)]

        async def via_file(write: bool) -> float:
            async with self.h.open(path, "w+") as f:
                t0 = time.perf_counter()
                if write:
                    f.truncate(size * count)  # sized up front, as fio lays out its file
                if write:
                    await asyncio.gather(*(f.pwrite(v, offset=i * size) for i, v in enumerate(views)))
                else:
                    await asyncio.gather(*(f.pread(v, offset=i * size) for i, v in enumerate(views)))
                return count / (time.perf_counter() - t0)

        async def via_path(write: bool) -> float:
            t0 = time.perf_counter()
            if write:
                await asyncio.gather(*(self.h.pwrite(v, path, offset=i * size) for i, v in enumerate(views)))
            else:
                await asyncio.gather(*(self.h.pread(v, path, offset=i * size) for i, v in enumerate(views)))
            return count / (time.perf_counter() - t0)

        k = f"{size // 1024}K"
        unlink(path)
        out[f"ops_write_{k}"].append(self.run(via_file(True)))
        drop_caches()
        out[f"ops_read_{k}"].append(self.run(via_file(False)))
        out[f"ops_write_{k}_path"].append(self.run(via_path(True)))
        drop_caches()
        out[f"ops_read_{k}_path"].append(self.run(via_path(False)))

    def close(self) -> None:
        self.run(self.h.aclose())


# -- DeepSpeed -----------------------------------------------------------------------------------
def ds_available() -> bool:
    return os.path.exists(DS_PY)


def ds_call(**kw: object) -> dict:
    args = [DS_PY, DS_SCRIPT]
    for k, v in kw.items():
        if v is True:
            args.append(f"--{k.replace('_', '-')}")
        elif v is not False and v is not None:
            args += [f"--{k.replace('_', '-')}", str(v)]
    r = subprocess.run(args, capture_output=True, text=True, timeout=600)
    line = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else "{}"
    res = json.loads(line)
    if not res.get("ok"):
        raise RuntimeError(f"DeepSpeed run failed: {res.get('error')} {r.stderr[-500:]}")
    return res


def ds_seq(path: str, size: int, buffer: str, out: dict[str, list[float]]) -> None:
    unlink(path)
    w = ds_call(path=path, size=size, mode="write", buffer=buffer)
    out["write_new"].append(w["gbps"])
    out["write_new_fsync"].append(w["gbps_with_fsync"])
    out["overwrite"].append(ds_call(path=path, size=size, mode="write", buffer=buffer)["gbps"])
    out["read"].append(ds_call(path=path, size=size, mode="read", buffer=buffer, drop_caches=True)["gbps"])


def ds_ops(path: str, size: int, count: int, out: dict[str, list[float]]) -> None:
    k = f"{size // 1024}K"
    unlink(path)
    with open(path, "wb") as f:  # sized up front, like fio's layout and dsio's run (same conditions)
        f.truncate(size * count)
    out[f"ops_write_{k}"].append(ds_call(path=path, mode="ops_write", ops=count, op_size=size)["ops_per_s"])
    out[f"ops_read_{k}"].append(
        ds_call(path=path, mode="ops_read", ops=count, op_size=size, drop_caches=True)["ops_per_s"]
    )


# -- fio -------------------------------------------------------------------------------------------
def fio_seq(path: str, size: int, engine: str, out: dict[str, list[float]]) -> None:
    common = dict(size=size, block_size=1 << 20, queue_depth=32, ioengine=engine)
    unlink(path)
    out["write_new_fsync"].append(fio.run_fio(path, rw="write", **common)["gbps"])
    out["overwrite"].append(fio.run_fio(path, rw="write", **common)["gbps"])
    drop_caches()
    out["read"].append(fio.run_fio(path, rw="read", **common)["gbps"])


def fio_ops(path: str, size: int, count: int, out: dict[str, list[float]]) -> None:
    k = f"{size // 1024}K"
    unlink(path)
    for qd in (1, 32):
        common = dict(size=size * count, block_size=size, queue_depth=qd, ioengine="libaio")
        out[f"ops_write_{k}_qd{qd}"].append(fio.run_fio(path, rw="randwrite", **common)["iops"])
        drop_caches()
        out[f"ops_read_{k}_qd{qd}"].append(fio.run_fio(path, rw="randread", **common)["iops"])


# -- report ------------------------------------------------------------------------------------------
SEQ_CASES = [
    ("write_new", "write, new file"),
    ("write_new_fsync", "write new + fsync"),
    ("overwrite", "overwrite"),
    ("read", "read (cold)"),
]


def med(res: Results, method: str, case: str) -> float | None:
    xs = res.get(method, {}).get(case)
    return summarize(xs)[0] if xs else None


def report(res: Results, meta: dict, args: argparse.Namespace) -> str:
    lines = [f"# dsio I/O benchmark, {meta['date']}", ""]
    lines.append("Machine: " + ", ".join(f"{k} {v}" for k, v in meta.items() if k != "date"))
    lines.append(
        f"Disk: `{args.dir}` ({fs_of(args.dir)}); {args.reps} interleaved reps; values are median (min-max)."
    )
    lines.append(f"Sequential size {args.size_gib} GiB. Page cache dropped before every read.")
    lines += ["", "## Sequential, GB/s", ""]
    lines.append("| method | " + " | ".join(c[1] for c in SEQ_CASES) + " |")
    lines.append("|---" * (len(SEQ_CASES) + 1) + "|")
    for m in res:
        if not any(c in res[m] for c, _ in SEQ_CASES):
            continue
        lines.append(f"| {m} | " + " | ".join(fmt(res[m].get(c, [])) for c, _ in SEQ_CASES) + " |")
    ds = "DeepSpeed aio_handle, locked"
    lines += ["", "### Ratios (medians, same run)", ""]
    lines.append("| dsio method | case | vs DeepSpeed locked | vs fio libaio |")
    lines.append("|---|---|---|---|")
    for m in res:
        if not m.startswith("dsio"):
            continue
        for c, label in SEQ_CASES:
            v = med(res, m, c)
            if v is None:
                continue
            d = med(res, ds, c)
            f = med(res, "fio libaio 1M QD32", c)
            lines.append(f"| {m} | {label} | {v / d:.2f}x |" if d else f"| {m} | {label} | - |")
            lines[-1] += f" {v / f:.2f}x |" if f else " - |"
    lines += ["", "## Small operations (2,000 concurrent), ops/s", ""]
    op_cases = sorted({c for m in res for c in res[m] if c.startswith("ops_")})
    for m in res:
        row = [(c, res[m][c]) for c in op_cases if c in res[m]]
        if row:
            lines.append(f"- **{m}**: " + "; ".join(f"{c.removeprefix('ops_')} {fmt(v, 0)}" for c, v in row))
    lines += ["", "### Op-rate ratios", ""]
    for size in ("64K", "1024K"):
        for kind in ("write", "read"):
            ours = med(res, "dsio io_uring (default config)", f"ops_{kind}_{size}")
            ours_path = med(res, "dsio io_uring (default config)", f"ops_{kind}_{size}_path")
            d = med(res, "DeepSpeed aio_handle", f"ops_{kind}_{size}")
            f32 = med(res, "fio libaio", f"ops_{kind}_{size}_qd32")
            if ours:
                parts = [f"dsio {size} {kind}: {ours:,.0f}/s (open file), {ours_path or 0:,.0f}/s (paths)"]
                if d:
                    parts.append(f"{ours / d:.2f}x DeepSpeed")
                if f32:
                    parts.append(f"{ours / f32:.2f}x fio QD32")
                lines.append("- " + ", ".join(parts))
    return "\n".join(lines) + "\n"


def plot(res: Results, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = [m for m in res if any(c in res[m] for c, _ in SEQ_CASES)]
    fig, ax = plt.subplots(figsize=(12, 5))
    width = 0.8 / max(1, len(methods))
    for i, m in enumerate(methods):
        vals = [med(res, m, c) or 0 for c, _ in SEQ_CASES]
        ax.bar([x + i * width for x in range(len(SEQ_CASES))], vals, width, label=m)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(SEQ_CASES))], [c[1] for c in SEQ_CASES])
    ax.set_ylabel("GB/s (median)")
    ax.set_title("1 GiB sequential I/O, interleaved reps")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/work/tmp-bench")
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--ops", type=int, default=2000)
    ap.add_argument("--skip-deepspeed", action="store_true")
    ap.add_argument("--skip-fio", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    size = int(args.size_gib * (1 << 30)) // (1 << 20) * (1 << 20)
    seq_path = os.path.join(args.dir, "seq.bin")
    ops_path = os.path.join(args.dir, "ops.bin")
    meta = machine()
    meta["torch"] = torch.__version__
    meta["dsio backends"] = ", ".join(s.name for s in dsio.backend_status() if s.available)

    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    locked = torch.frombuffer(dsio._C.AlignedBuffer(size, True), dtype=torch.uint8)
    locked.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8))
    plain = torch.randn(size // 4)  # an ordinary tensor: not 4096-aligned, not locked
    assert plain.data_ptr() % 4096 != 0 or True
    ops_buf = torch.frombuffer(dsio._C.AlignedBuffer(args.ops << 20, True), dtype=torch.uint8)
    ops_buf.fill_(7)

    default = dsio.IOConfig()
    backends = [s.name for s in dsio.backend_status() if s.available]
    runners = {b: DsioRunner(loop, dsio.IOConfig(backend=b)) for b in backends}
    steps: list[tuple[str, Callable[[dict[str, list[float]]], None]]] = []
    for b in backends:
        steps.append((f"dsio {b}, locked buffer", lambda o, b=b: runners[b].seq(locked, seq_path, o)))
        steps.append((f"dsio {b}, ordinary tensor", lambda o, b=b: runners[b].seq(plain, seq_path, o)))
    use_ds = ds_available() and not args.skip_deepspeed
    use_fio = fio.fio_available() and not args.skip_fio
    if use_ds:
        steps.append(("DeepSpeed aio_handle, locked", lambda o: ds_seq(seq_path, size, "locked", o)))
        steps.append(("DeepSpeed aio_handle, ordinary tensor", lambda o: ds_seq(seq_path, size, "plain", o)))
    if use_fio:
        steps.append(("fio libaio 1M QD32", lambda o: fio_seq(seq_path, size, "libaio", o)))
        steps.append(("fio io_uring 1M QD32", lambda o: fio_seq(seq_path, size, "io_uring", o)))
    for op_size in (64 << 10, 1 << 20):
        steps.append(
            (
                "dsio io_uring (default config)",
                lambda o, s=op_size: runners[
                    default.backend if default.backend != "auto" else backends[0]
                ].ops(ops_buf, s, args.ops, ops_path, o),
            )
        )
        if use_ds:
            steps.append(("DeepSpeed aio_handle", lambda o, s=op_size: ds_ops(ops_path, s, args.ops, o)))
        if use_fio:
            steps.append(("fio libaio", lambda o, s=op_size: fio_ops(ops_path, s, args.ops, o)))

    res: Results = defaultdict(lambda: defaultdict(list))
    with tqdm(total=args.reps * len(steps), desc="bench io", unit="step") as bar:
        for rep in range(args.reps):
            for name, fn in steps:
                bar.set_postfix_str(f"rep {rep + 1}: {name}")
                fn(res[name])
                bar.update()
    for r in runners.values():
        r.close()
    for p in (seq_path, ops_path):
        unlink(p)

    md = report(res, meta, args)
    out = result_path("io")
    with open(out, "w") as f:
        f.write(md)
    with open(result_path("io", "json"), "w") as f:
        json.dump({"meta": meta, "results": res}, f, indent=1)
    plot(res, result_path("io", "png"))
    print(md)
    print(f"written: {out}")


if __name__ == "__main__":
    main()
