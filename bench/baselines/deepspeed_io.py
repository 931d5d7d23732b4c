"""DeepSpeed DeepNVMe (aio_handle) baseline: one measurement, one JSON line on stdout.

Run with the DeepSpeed venv's interpreter (made by setup_deepspeed.sh), not the project's:

    "$DSIO_DEEPSPEED_VENV"/bin/python bench/baselines/deepspeed_io.py --path F --size 1073741824 --mode write

Modes:
  write      h.sync_pwrite(buffer, path) of --size bytes. The file is opened without O_TRUNC
             (DeepSpeed's behaviour): delete it first for the fresh-file case, keep it for
             overwrite. "seconds"/"gbps" time only the DeepSpeed call; "gbps_with_fsync" adds
             open + os.fsync + close of the file afterwards.
  read       h.sync_pread(buffer, path) of --size bytes (drop caches before, or --drop-caches).
  ops_write  --ops h.async_pwrite calls of --op-size bytes each, to distinct offsets of one file
             (--ops-layout offsets, default) or to distinct files PATH.NNNNN (files), then one
             h.wait(); reports ops/s (and ops/s including an fsync of the file(s)).
  ops_read   the same with h.async_pread.

  serve      keep one handle and one locked buffer of --size bytes (DeepSpeed's own benchmark
             pattern: the buffer is allocated once) and answer JSON commands, one per stdin line:
               {"op": "read"|"write", "path": P, "offset": O, "size": N}
             with one JSON line each: {"ok", "error", "seconds", "gbps", "rc"}. The caller drops
             the page cache between commands. EOF on stdin ends it.

For read modes a missing or short file is written first (untimed, reported as "prepared").
Every DeepSpeed message (C++ std::cout included) goes to stderr; stdout carries only the JSON:
  {"ok", "error", "mode", "gbps", "seconds", "gbps_with_fsync", "seconds_with_fsync",
   "ops_per_s", "ops_per_s_with_fsync", "submit_us_per_op", "bytes", "ops", "file_size",
   "prepared", "buffer", "block_size", "queue_depth", "threads", "single_submit",
   "overlap_events", "cold", "deepspeed", "torch"}
"cold" is null unless --drop-caches was given, then whether the drop verifiably worked.
Fields that do not apply to a mode are null. gbps is decimal (bytes / s / 1e9).

DeepSpeed quirks this script guards against (see shared/ANCHORS.md): a size not a multiple of
512 x threads silently loses its tail, so written file sizes are checked ("ok": false if wrong);
reading a short file hits a compiled-in assert, so read sizes are checked before the call.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

MIB = 1 << 20


def _redirect_stdout_to_stderr() -> int:
    """Point fd 1 at stderr (DeepSpeed's C++ prints to stdout); return a dup of the real stdout."""
    sys.stdout.flush()
    real = os.dup(1)
    os.dup2(2, 1)
    return real


def _emit(fd: int, result: dict) -> None:
    os.write(fd, (json.dumps(result) + "\n").encode())


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _drop_caches(*paths: str) -> bool:
    """Drop the page cache; True only if it worked and mincore shows ``paths`` uncached."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from bench._common import drop_caches_verified  # stdlib only: importable from this venv

    return drop_caches_verified(*paths)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--path", required=True, help="file (ops_* with --ops-layout files: prefix)")
    p.add_argument(
        "--size", type=int, default=1 << 30, help="bytes for write/read (multiple of 1 MiB advised)"
    )
    p.add_argument("--mode", choices=("write", "read", "ops_write", "ops_read", "serve"), required=True)
    p.add_argument("--block-size", type=int, default=MIB, help="aio_handle block_size (default 1 MiB)")
    p.add_argument("--queue-depth", type=int, default=128, help="aio_handle queue_depth (default 128)")
    p.add_argument("--threads", type=int, default=1, help="aio_handle intra_op_parallelism (default 1)")
    p.add_argument("--single-submit", action="store_true", help="aio_handle single_submit=True")
    p.add_argument("--overlap-events", action="store_true", help="aio_handle overlap_events=True")
    p.add_argument(
        "--buffer",
        choices=("locked", "plain"),
        default="locked",
        help="locked: h.new_cpu_locked_tensor; plain: an ordinary torch tensor",
    )
    p.add_argument("--ops", type=int, default=2000, help="ops_*: number of async calls")
    p.add_argument("--op-size", type=int, default=64 * 1024, help="ops_*: bytes per call")
    p.add_argument(
        "--ops-layout",
        choices=("offsets", "files"),
        default="offsets",
        help="ops_*: distinct offsets of one file, or one file per op",
    )
    p.add_argument(
        "--drop-caches",
        action="store_true",
        help="read modes: sync + drop the page cache right before the timed part (root)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    out_fd = _redirect_stdout_to_stderr()
    os.environ["_DSIO_SERVE_FD"] = str(out_fd)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))

    result: dict = {
        "ok": False,
        "error": None,
        "mode": args.mode,
        "gbps": None,
        "seconds": None,
        "gbps_with_fsync": None,
        "seconds_with_fsync": None,
        "ops_per_s": None,
        "ops_per_s_with_fsync": None,
        "submit_us_per_op": None,
        "bytes": None,
        "ops": None,
        "file_size": None,
        "prepared": False,
        "buffer": args.buffer,
        "block_size": args.block_size,
        "queue_depth": args.queue_depth,
        "threads": args.threads,
        "single_submit": args.single_submit,
        "overlap_events": args.overlap_events,
        "cold": None,
        "deepspeed": None,
        "torch": None,
    }
    try:
        _run(args, result)
    except Exception as e:  # report, don't crash: the caller reads one JSON line
        result["ok"] = False
        result["error"] = f"{type(e).__name__}: {e}"
    _emit(out_fd, result)
    return 0 if result["ok"] else 1


def _run(args: argparse.Namespace, result: dict) -> None:
    import deepspeed
    import torch
    from deepspeed.ops.op_builder import AsyncIOBuilder

    result["deepspeed"] = deepspeed.__version__
    result["torch"] = torch.__version__
    torch.manual_seed(0)

    align = 512 * args.threads
    if args.mode == "serve":
        args.buffer = "locked"
    ops_mode = args.mode.startswith("ops_")
    total = args.ops * args.op_size if ops_mode else args.size
    unit = args.op_size if ops_mode else args.size
    if unit <= 0 or (ops_mode and args.ops <= 0):
        raise ValueError("sizes and --ops must be positive")
    if unit % align:
        print(
            f"deepspeed_io: warning: {unit} bytes is not a multiple of 512 x threads = {align}; "
            "DeepSpeed will silently drop the tail",
            file=sys.stderr,
        )

    mod = AsyncIOBuilder().load(verbose=False)
    h = mod.aio_handle(
        args.block_size, args.queue_depth, args.single_submit, args.overlap_events, args.threads
    )

    # The buffer: locked (page-aligned + mlock, DeepSpeed's fast path) or an ordinary tensor
    # (DeepSpeed bounces it through a locked temporary on every call).
    example = torch.empty(0, dtype=torch.uint8)
    if args.buffer == "locked":
        buf = h.new_cpu_locked_tensor(total, example)
    else:
        buf = torch.empty(total, dtype=torch.uint8)
    chunk = torch.randn(min(total, 64 * MIB) // 4 + 1).view(torch.uint8)[: min(total, 64 * MIB)]
    for off in range(0, total, chunk.numel()):
        n = min(chunk.numel(), total - off)
        buf[off : off + n].copy_(chunk[:n])

    try:
        if args.mode == "serve":
            _serve(h, buf)
        elif args.mode == "write":
            _write(h, buf, args, result)
        elif args.mode == "read":
            _read(h, buf, args, result)
        else:
            _ops(h, buf, args, result)
    finally:
        if args.buffer == "locked":
            h.free_cpu_locked_tensor(buf)


def _serve(h, buf) -> None:
    """Answer read/write commands from stdin on the real stdout (see the module docstring)."""
    import resource

    out = int(os.environ["_DSIO_SERVE_FD"])
    _emit(out, {"ok": True, "ready": True, "capacity": buf.numel()})
    for line in sys.stdin:
        if not line.strip():
            continue
        res: dict = {"ok": False, "error": None, "seconds": None, "gbps": None, "rc": None}
        try:
            cmd = json.loads(line)
            n = int(cmd["size"])
            if n > buf.numel():
                raise ValueError(f"size {n} exceeds the buffer ({buf.numel()} bytes)")
            view = buf[:n]
            path, off = cmd["path"], int(cmd.get("offset", 0))
            ru = resource.getrusage(resource.RUSAGE_SELF)
            flt0, ut0, st0 = ru.ru_minflt, ru.ru_utime, ru.ru_stime
            if cmd["op"] == "read":
                if os.path.getsize(path) < off + n:  # DeepSpeed would hit a C++ assert
                    raise ValueError(f"{path} is shorter than {off + n} bytes")
                t0 = time.perf_counter()
                rc = h.sync_pread(view, path, off)
            elif cmd["op"] == "write":
                t0 = time.perf_counter()
                rc = h.sync_pwrite(view, path, off)
            else:
                raise ValueError(f"unknown op {cmd['op']!r}")
            dt = time.perf_counter() - t0
            ru = resource.getrusage(resource.RUSAGE_SELF)
            res.update(seconds=dt, gbps=n / dt / 1e9, rc=rc, ok=rc >= 0)
            res.update(minflt=ru.ru_minflt - flt0, utime=ru.ru_utime - ut0, stime=ru.ru_stime - st0)
            if rc < 0:
                res["error"] = f"DeepSpeed returned {rc}"
        except Exception as e:
            res["error"] = f"{type(e).__name__}: {e}"
        _emit(out, res)


def _write(h, buf, args, result) -> None:
    t0 = time.perf_counter()
    rc = h.sync_pwrite(buf, args.path)
    t1 = time.perf_counter()
    _fsync_path(args.path)
    t2 = time.perf_counter()
    size = os.path.getsize(args.path)
    result.update(
        seconds=t1 - t0,
        seconds_with_fsync=t2 - t0,
        bytes=args.size,
        file_size=size,
        gbps=args.size / (t1 - t0) / 1e9,
        gbps_with_fsync=args.size / (t2 - t0) / 1e9,
    )
    if rc < 0:
        result["error"] = f"sync_pwrite returned {rc}"
    elif size != args.size:
        why = (
            "DeepSpeed does not truncate: an older, larger file keeps its tail"
            if size > args.size
            else "DeepSpeed lost the tail (size not a multiple of 512 x threads?)"
        )
        result["error"] = f"file size {size} != {args.size}: {why}"
    else:
        result["ok"] = True


def _prepare(h, buf, path: str, nbytes: int, result: dict) -> None:
    """Make sure `path` holds at least nbytes (untimed), so DeepSpeed's read assert can't fire."""
    if not os.path.exists(path) or os.path.getsize(path) < nbytes:
        rc = h.sync_pwrite(buf[:nbytes], path)
        _fsync_path(path)
        if rc < 0 or os.path.getsize(path) < nbytes:
            raise RuntimeError(f"could not prepare {path} with {nbytes} bytes")
        result["prepared"] = True


def _read(h, buf, args, result) -> None:
    _prepare(h, buf, args.path, args.size, result)
    if args.drop_caches:
        result["cold"] = _drop_caches(args.path)
    t0 = time.perf_counter()
    rc = h.sync_pread(buf, args.path)
    t1 = time.perf_counter()
    result.update(
        seconds=t1 - t0,
        bytes=args.size,
        file_size=os.path.getsize(args.path),
        gbps=args.size / (t1 - t0) / 1e9,
    )
    if rc < 0:
        result["error"] = f"sync_pread returned {rc}"
    else:
        result["ok"] = True


def _ops(h, buf, args, result) -> None:
    n, sz = args.ops, args.op_size
    if args.ops_layout == "offsets":
        targets = [(args.path, i * sz) for i in range(n)]
    else:
        targets = [(f"{args.path}.{i:05d}", 0) for i in range(n)]
    read = args.mode == "ops_read"
    if read:
        if args.ops_layout == "offsets":
            _prepare(h, buf, args.path, n * sz, result)
        else:
            for i, (p, _) in enumerate(targets):
                _prepare(h, buf[i * sz : (i + 1) * sz], p, sz, result)
        if args.drop_caches:
            result["cold"] = _drop_caches(*{p for p, _ in targets})
    submit = h.async_pread if read else h.async_pwrite
    # Every pending path-based op holds an open fd until wait(): lift the soft fd limit.
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < n + 256:
        resource.setrlimit(
            resource.RLIMIT_NOFILE,
            (hard if hard == resource.RLIM_INFINITY else min(hard, max(n + 256, soft)), hard),
        )

    t0 = time.perf_counter()
    bad = 0
    for i, (p, off) in enumerate(targets):
        if submit(buf[i * sz : (i + 1) * sz], p, off) != 0:
            bad += 1
    t_sub = time.perf_counter()
    done = h.wait() if bad < n else 0  # wait() with nothing pending hits a C++ assert
    t1 = time.perf_counter()
    paths = sorted({p for p, _ in targets})
    if not read:
        for p in paths:
            _fsync_path(p)
    t2 = time.perf_counter()

    result.update(
        ops=n,
        bytes=n * sz,
        seconds=t1 - t0,
        ops_per_s=n / (t1 - t0),
        gbps=n * sz / (t1 - t0) / 1e9,
        submit_us_per_op=(t_sub - t0) / n * 1e6,
    )
    if not read:
        result.update(
            seconds_with_fsync=t2 - t0,
            ops_per_s_with_fsync=n / (t2 - t0),
            gbps_with_fsync=n * sz / (t2 - t0) / 1e9,
        )
    sizes = [os.path.getsize(p) for p in paths]
    result["file_size"] = sum(sizes)
    if bad or done != n - bad:
        result["error"] = f"{bad} submits failed, wait() reported {done} of {n} ops"
    elif not read and (sizes[0] != n * sz if args.ops_layout == "offsets" else min(sizes) != sz):
        result["error"] = f"file sizes {sizes[:3]}... do not match {n} x {sz} bytes"
    else:
        result["ok"] = True


if __name__ == "__main__":
    sys.exit(main())
