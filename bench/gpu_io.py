"""GPU <-> disk benchmark (run on the H200 through `make gpu-check`), interleaved rep by rep.

    python bench/gpu_io.py --dir "$DSIO_BENCH_DIR" --size-gib 4 --reps 3 --out results/

Methods, each writing a new file from a CUDA tensor and reading it back into one:
  dsio bounce  (pipelined pinned host buffers, side-stream copies, O_DIRECT)
  dsio cufile  (cuFileRead/Write; compat mode where nvidia-fs is absent)
  dsio host-pinned (a pinned host tensor: what the disk allows, the ceiling for GPU paths)
  tensor.cpu() + torch.save + fsync / torch.load + .cuda()
  kvikio CuFile write/read (when it imports)
Writes are durable (fsync) for every method; page cache dropped before reads where permitted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dsio  # noqa: E402
from bench._common import drop_caches, scratch_dir  # noqa: E402
from dsio._memory import aligned_buffer  # noqa: E402


def fsync_path(p: str) -> None:
    fd = os.open(p, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def rm(p: str) -> None:
    if os.path.exists(p):
        os.unlink(p)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=None, help="scratch folder (default: bench/_common.scratch_dir())")
    ap.add_argument("--size-gib", type=float, default=4.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    a.dir = a.dir or scratch_dir()
    os.makedirs(a.dir, exist_ok=True)
    os.makedirs(a.out, exist_ok=True)
    n = int(a.size_gib * (1 << 30))
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    pinned = torch.frombuffer(aligned_buffer(n), dtype=torch.uint8)
    torch.cuda.cudart().cudaHostRegister(pinned.data_ptr(), n, 0)
    pinned.copy_(src)
    path = os.path.join(a.dir, "gpu.bin")
    loop = asyncio.new_event_loop()
    handles = {
        "bounce": dsio.AsyncIOHandle(
            gpu_backend="bounce",
            queue_depth=32,
            intra_op_parallelism=2,
            pool_bytes=256 << 20,
            staging_buffer_bytes=16 << 20,
        ),
    }
    st = __import__("dsio.gpu", fromlist=["gpu_status"]).gpu_status()
    if st.cufile:
        handles["cufile"] = dsio.AsyncIOHandle(
            gpu_backend="cufile", block_size=16 << 20, intra_op_parallelism=4
        )
    host = dsio.AsyncIOHandle(queue_depth=32, intra_op_parallelism=2)
    try:
        import kvikio  # type: ignore[import-not-found]

        kv_version = kvikio.__version__
    except Exception as e:  # noqa: BLE001
        kvikio, kv_version = None, f"unavailable: {e}"

    res: dict[str, dict[str, list[float]]] = {}

    def rec(m: str, case: str, secs: float) -> None:
        res.setdefault(m, {}).setdefault(case, []).append(n / secs / 1e9)

    def timed(fn) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def dsio_method(name: str, h: dsio.AsyncIOHandle, s: torch.Tensor, d: torch.Tensor) -> None:
        rm(path)
        rec(name, "write", timed(lambda: loop.run_until_complete(h.pwrite(s, path, fsync=True))))
        drop_caches()
        rec(name, "read", timed(lambda: loop.run_until_complete(h.pread(d, path))))

    def torch_save() -> None:
        rm(path)

        def w() -> None:
            torch.save(src.cpu(), path)
            fsync_path(path)

        rec("tensor.cpu() + torch.save", "write", timed(w))
        drop_caches()
        rec("tensor.cpu() + torch.save", "read", timed(lambda: dst.copy_(torch.load(path).cuda())))

    def kvikio_method() -> None:
        rm(path)

        def w() -> None:
            with kvikio.CuFile(path, "w") as f:
                f.write(src)
            fsync_path(path)

        rec("kvikio CuFile", "write", timed(w))
        drop_caches()

        def r() -> None:
            with kvikio.CuFile(path, "r") as f:
                f.read(dst)

        rec("kvikio CuFile", "read", timed(r))

    methods = [(f"dsio {k}", lambda k=k: dsio_method(f"dsio {k}", handles[k], src, dst)) for k in handles]
    methods.append(
        (
            "dsio host-pinned (ceiling)",
            lambda: dsio_method("dsio host-pinned (ceiling)", host, pinned, pinned),
        )
    )
    methods.append(("torch.save", torch_save))
    if kvikio is not None:
        methods.append(("kvikio", kvikio_method))
    errors: dict[str, str] = {}
    for rep in range(a.reps):
        for name, fn in methods:
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - record and go on; the report shows it
                errors[name] = repr(e)[:300]
            print(f"rep {rep + 1}/{a.reps} {name}: done", flush=True)
    for h in [*handles.values(), host]:
        loop.run_until_complete(h.aclose())
    rm(path)

    gpu = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    df = subprocess.run(["df", "-T", a.dir], capture_output=True, text=True).stdout.splitlines()[-1]
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "gpu": gpu,
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "torch": torch.__version__,
        "disk": " ".join(df.split()[:2]),
        "drop_caches": drop_caches(),
        "size_gib": a.size_gib,
        "reps": a.reps,
        "gpu_status": str(st),
        "kvikio": kv_version,
    }
    lines = [
        f"# GPU <-> disk, {meta['date']}",
        "",
        *(f"- {k}: {v}" for k, v in meta.items()),
        "",
        "GB/s, median (min-max) of interleaved reps; writes fsync'ed.",
        "",
        "| method | write | read |",
        "|---|---|---|",
    ]
    med = {m: {c: statistics.median(v) for c, v in cs.items()} for m, cs in res.items()}
    for m, cs in res.items():
        cells = [
            f"{statistics.median(cs[c]):.2f} ({min(cs[c]):.2f}-{max(cs[c]):.2f})" if c in cs else "-"
            for c in ("write", "read")
        ]
        lines.append(f"| {m} | {cells[0]} | {cells[1]} |")
    ceil = med.get("dsio host-pinned (ceiling)", {})
    kv = med.get("kvikio CuFile", {})
    lines += ["", "Ratios:"]
    for m in med:
        if m.startswith("dsio") and "ceiling" not in m:
            for c in ("write", "read"):
                if c in med[m] and c in ceil:
                    extra = f", {med[m][c] / kv[c]:.2f}x kvikio" if c in kv else ""
                    lines.append(f"- {m} {c}: {med[m][c] / ceil[c]:.2f}x host-pinned{extra}")
    if errors:
        lines += ["", "Errors:", *(f"- {k}: {v}" for k, v in errors.items())]
    md = "\n".join(lines) + "\n"
    print(md)
    with open(os.path.join(a.out, "gpu_io.md"), "w") as f:
        f.write(md)
    with open(os.path.join(a.out, "gpu_io.json"), "w") as f:
        json.dump({"meta": meta, "results": res, "errors": errors}, f, indent=1)


if __name__ == "__main__":
    main()
