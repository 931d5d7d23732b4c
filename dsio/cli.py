"""The ``dsio`` command: ``report`` (what this machine can do, and why not), ``tune`` (sweep the
engine's knobs and write a dstrain ``"aio"`` block), ``bench`` (quick GB/s and op rate).

``report`` lives in :mod:`dsio._report`, ``tune`` (its early-stopping sweep, CSV and plot) in
:mod:`dsio._tune`, what the commands share in :mod:`dsio._cli_common`; this module parses
arguments, dispatches, and runs ``bench``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from ._cli_common import (
    AIO_KEYS,
    CliError,
    backend_name,
    buffer,
    check_dir,
    human,
    list_of,
    parse_size,
    pos_int,
    pow2_size,
    run,
    size_arg,
)
from ._report import report

__all__ = ["main", "parse_size"]


# -- tune (dsio/_tune.py) ------------------------------------------------------------------------
def _tune(args: argparse.Namespace) -> int:
    """``dsio tune``: the sweep lives in :mod:`dsio._tune`; this is its entry point."""
    from ._tune import tune

    return tune(args)


# -- bench ---------------------------------------------------------------------------------------
def _load_config(path: str | None, args: argparse.Namespace) -> Any:
    """The IOConfig ``bench`` measures: a DeepSpeed/``dsio tune`` ``"aio"`` block parsed by its one
    parser (``IOConfig.from_deepspeed``), then the command-line knobs on top."""
    from .config import IOConfig
    from .errors import ConfigError

    overrides: dict[str, Any] = {
        key: getattr(args, key) for key in (*AIO_KEYS, "backend") if getattr(args, key, None) is not None
    }
    overrides.update(pool_bytes=1 << 20, staging_buffer_bytes=1 << 20)  # aligned buffers: no staging
    try:
        if not path:
            return IOConfig(**overrides)
        try:
            with open(path) as f:
                doc = json.load(f)
        except OSError as e:
            raise CliError(f"cannot read --config {path}: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise CliError(f"--config {path} is not JSON: {e}") from None
        block = doc.get("aio", doc) if isinstance(doc, dict) else None
        if not isinstance(block, dict):
            raise CliError(f'--config {path}: expected a JSON object (an "aio" block)')
        return IOConfig.from_deepspeed(block, **overrides)
    except ConfigError as e:
        raise CliError(f"invalid configuration: {e}") from None


#: What one bench repetition measures, in order (one progress step each).
_PHASES = ("write_new_gbps", "write_overwrite_gbps", "read_gbps", "write_ops_per_s", "read_ops_per_s")


async def _bench_rep(
    cfg: Any,
    d: str,
    size: int,
    op_size: int,
    n_ops: int,
    conc: int,
    buf: Any,
    step: Any = lambda: None,
) -> dict[str, float]:
    from .handle import AsyncIOHandle

    out: dict[str, float] = {}
    big = os.path.join(d, f".dsio-bench-{os.getpid()}.bin")
    small = os.path.join(d, f".dsio-bench-ops-{os.getpid()}.bin")
    async with AsyncIOHandle(cfg) as h:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(big)
        t0 = time.perf_counter()
        await h.pwrite(buf, big, fsync=True)
        out["write_new_gbps"] = size / (time.perf_counter() - t0) / 1e9
        step()
        t0 = time.perf_counter()
        await h.pwrite(buf, big, offset=0, fsync=True)
        out["write_overwrite_gbps"] = size / (time.perf_counter() - t0) / 1e9
        step()
        t0 = time.perf_counter()
        await h.pread(buf, big)
        out["read_gbps"] = size / (time.perf_counter() - t0) / 1e9
        step()
        os.unlink(big)
        sem = asyncio.Semaphore(conc)
        piece = buf[:op_size]
        async with h.open(small, "w+") as f:
            f.truncate(op_size * n_ops)

            async def one(op: str, i: int) -> None:
                async with sem:
                    await (f.pwrite(piece, i * op_size) if op == "write" else f.pread(piece, i * op_size))

            for op in ("write", "read"):
                t0 = time.perf_counter()
                await asyncio.gather(*(one(op, i) for i in range(n_ops)))
                out[f"{op}_ops_per_s"] = n_ops / (time.perf_counter() - t0)
                step()
        os.unlink(small)
    return out


def _bench(args: argparse.Namespace) -> int:
    cfg = _load_config(args.config, args)
    d = check_dir(args.dir, args.size + args.op_size * args.ops + (16 << 20))
    buf = buffer(max(args.size, args.op_size), False)
    reps: list[dict[str, float]] = []
    from tqdm import tqdm

    try:
        with tqdm(
            total=args.reps * len(_PHASES),
            desc="dsio bench",
            unit="step",
            disable=args.quiet,
            file=sys.stderr,
        ) as bar:
            for _ in range(args.reps):
                reps.append(
                    run(
                        _bench_rep(
                            cfg, d, args.size, args.op_size, args.ops, args.concurrency, buf, bar.update
                        )
                    )
                )
    except OSError as e:
        raise CliError(f"I/O failed in {d}: {e}") from None
    summary = {
        k: {
            "median": statistics.median(r[k] for r in reps),
            "min": min(r[k] for r in reps),
            "max": max(r[k] for r in reps),
        }
        for k in reps[0]
    }
    from .handle import AsyncIOHandle

    with AsyncIOHandle(cfg) as h:
        backend = h.backend
    conf = {"backend": backend, **{k: getattr(cfg, k) for k in AIO_KEYS}}
    if args.json:
        print(
            json.dumps(
                {"config": conf, "size": args.size, "op_size": args.op_size, "reps": args.reps, **summary},
                indent=2,
            )
        )
        return 0
    print(f"dsio bench: {d}, {human(args.size)} transfers, {args.ops} x {human(args.op_size)} ops (concurrency "
          f"{args.concurrency}), median of {args.reps} (min-max)")  # fmt: skip
    print("  config  " + " ".join(f"{k}={v}" for k, v in conf.items()))
    for key, label, unit in (
        ("write_new_gbps", "write, new file", "GB/s"),
        ("write_overwrite_gbps", "write, overwrite", "GB/s"),
        ("read_gbps", "read", "GB/s"),
        ("write_ops_per_s", f"{human(args.op_size)} writes", "ops/s"),
        ("read_ops_per_s", f"{human(args.op_size)} reads", "ops/s"),
    ):
        s = summary[key]
        fmt = "{:,.0f}" if unit == "ops/s" else "{:.2f}"
        print(
            f"  {label:<18} {fmt.format(s['median']):>9} {unit:<5} ({fmt.format(s['min'])}-{fmt.format(s['max'])})"
        )
    return 0


# -- entry point ---------------------------------------------------------------------------------
def _version() -> str:
    from . import __version__

    return f"dsio {__version__}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsio", description="dsio: asyncio-native tensor I/O tools")
    p.add_argument("--version", action="version", version=_version(), help="print dsio's version and exit")
    sub = p.add_subparsers(dest="command", metavar="{report,tune,bench}")
    sub.required = True

    r = sub.add_parser("report", help="what this machine supports, and why not")
    r.add_argument(
        "--dir", action="append", help="directory to probe for O_DIRECT (repeatable; default: cwd)"
    )
    r.add_argument("--json", action="store_true", help="machine-readable output")
    r.set_defaults(func=report)

    t = sub.add_parser(
        "tune",
        help='sweep engine settings, write the best dstrain "aio" block',
        description="Stands in for DeepSpeed's ds_nvme_tune and takes its options with its meaning "
        "(--nvme_dir, --sweep_config, --no_read, --no_write, --io_size, --gpu, --gds, --flush_page_cache, "
        "--log_dir, --loops, --verbose); dsio's own names (--dir, --size, --reps, --out, the list flags) "
        "are aliases. The emitted aio block names the tuned backend.",
    )
    t.add_argument(
        "--dir",
        "--nvme_dir",
        dest="dir",
        nargs="+",
        action="extend",
        required=True,
        metavar="DIR",
        help="directory (or directories: each transfer is split over them and runs on all at once, as "
        "ds_nvme_tune's one folder per device) on the storage to tune for",
    )
    t.add_argument(
        "--size",
        "--io_size",
        dest="size",
        type=size_arg,
        default=1 << 30,
        help="bytes per transfer in the final rung (default 1G)",
    )
    t.add_argument("--gpu", action="store_true", help="transfer to/from a CUDA tensor")
    t.add_argument(
        "--gds",
        action="store_true",
        help="ds_nvme_tune's --gds: GPU tensors through cuFile (GPUDirect Storage); implies --gpu, and the "
        'aio block gets "use_gds": true',
    )
    t.add_argument(
        "--sweep_config",
        metavar="FILE",
        help="a JSON sweep in DeepSpeed's format (block_size, queue_depth, io_parallel, single_submit, "
        "sequential_requests lists); replaces the list flags for the keys it names",
    )
    t.add_argument("--no_read", action="store_true", help="measure writes only (the block favours write)")
    t.add_argument("--no_write", action="store_true", help="measure reads only (the block favours read)")
    t.add_argument(
        "--flush_page_cache",
        action="store_true",
        help="accepted for ds_nvme_tune's scripts: every transfer here is O_DIRECT, which bypasses the page "
        "cache, so there is nothing to flush (tune says so, or names a directory without O_DIRECT)",
    )
    t.add_argument(
        "--out",
        default=None,
        help="output prefix: PREFIX.json, .csv, .png (default ./dsio_tune, or LOG_DIR/dsio_tune)",
    )
    t.add_argument(
        "--log_dir",
        default=None,
        help="ds_nvme_tune's output directory (created if missing): results go to LOG_DIR/dsio_tune.*",
    )
    t.add_argument("--verbose", action="store_true", help="print the arguments and every measurement")
    t.add_argument(
        "--backends",
        type=list_of(backend_name),
        metavar="LIST",
        help="io_uring,aio,posix (default: all available)",
    )
    t.add_argument(
        "--block-sizes",
        type=list_of(pow2_size),
        default=[256 << 10, 1 << 20, 4 << 20, 8 << 20],
        metavar="LIST",
        help="block_size values (default 256K,1M,4M,8M)",
    )
    t.add_argument(
        "--queue-depths",
        type=list_of(pos_int),
        default=[8, 32, 128],
        metavar="LIST",
        help="default 8,32,128",
    )
    t.add_argument(
        "--parallelism",
        type=list_of(pos_int),
        default=[1, 2],
        metavar="LIST",
        help="intra_op_parallelism values (default 1,2)",
    )
    t.add_argument(
        "--reps",
        "--loops",
        dest="reps",
        type=pos_int,
        default=3,
        help="interleaved repetitions of the final rung",
    )
    t.add_argument("--finalists", type=pos_int, default=6, help="points per op that reach the final rung")
    goal = t.add_mutually_exclusive_group()
    goal.add_argument(
        "--workload",
        choices=("checkpoint", "offload"),
        help="what the aio block is for: checkpoint favours the fastest write settings (saves are what "
        "training waits for), offload the fastest read settings (ZeRO-Infinity reads on the critical "
        "path, writes behind it). Default: balanced",
    )
    goal.add_argument(
        "--optimize",
        choices=("balanced", "read", "write"),
        default=None,
        help="what the aio block is best at (balanced, the default: geometric mean of read and write vs "
        "the best of each)",
    )
    t.add_argument("--quiet", action="store_true", help="no progress bar")
    t.set_defaults(func=_tune)

    b = sub.add_parser(
        "bench",
        help="quick read/write GB/s and small-op rate",
        description=(
            "Measure one engine configuration on the storage under --dir: a --size write to a new "
            "file, the same write over it, a read back (GB/s, each with fsync for writes), then --ops "
            "small writes and reads of --op-size at sequential offsets with --concurrency "
            "in flight (ops/s). Repeated --reps times; prints the median and min-max of each. "
            "Without --config and knobs the engine runs dsio's defaults (IOConfig())."
        ),
        epilog=(
            "Example: dsio bench --dir /nvme --size 1G --config ds_config.json --queue-depth 64. "
            "Results on a shared or virtual disk vary between runs: compare configurations by "
            "interleaving them, not against a number from another day."
        ),
    )
    b.add_argument(
        "--dir",
        required=True,
        help="directory on the storage to measure; needs --size + ops x op-size free (files are removed)",
    )
    b.add_argument(
        "--size", type=size_arg, default=1 << 30, help="bytes per large transfer, e.g. 256M, 1G (default 1G)"
    )
    b.add_argument(
        "--config",
        help='JSON file holding a DeepSpeed "aio" block (a whole DeepSpeed config, or dsio tune\'s output); '
        "keys it leaves out take DeepSpeed's defaults",
    )
    b.add_argument(
        "--backend", type=backend_name, help="io_uring, aio or posix (default: the first that works here)"
    )
    b.add_argument(
        "--block-size",
        dest="block_size",
        type=pow2_size,
        help="bytes per piece a request is split into: a power of two >= 4K (default 1M)",
    )
    b.add_argument(
        "--queue-depth", dest="queue_depth", type=pos_int, help="pieces in flight per worker (default 64)"
    )
    b.add_argument(
        "--intra-op-parallelism",
        dest="intra_op_parallelism",
        type=pos_int,
        help="worker threads, each with its own ring or AIO context (default 2)",
    )
    b.add_argument(
        "--single-submit",
        dest="single_submit",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="one submit syscall per piece instead of batching every ready piece (default off)",
    )
    b.add_argument(
        "--overlap-events",
        dest="overlap_events",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="refill the queue as each piece completes; --no-overlap-events waits for whole batches "
        "(DeepSpeed's lock-step) (default on)",
    )
    b.add_argument("--op-size", type=size_arg, default=64 << 10, help="bytes per small op (default 64K)")
    b.add_argument("--ops", type=pos_int, default=2000, help="small ops per measurement (default 2000)")
    b.add_argument("--concurrency", type=pos_int, default=32, help="small ops in flight at once (default 32)")
    b.add_argument("--reps", type=pos_int, default=3, help="repetitions; the median is reported (default 3)")
    b.add_argument(
        "--json", action="store_true", help="print the results as JSON (median, min, max per metric)"
    )
    b.add_argument("--quiet", action="store_true", help="no progress bar (it goes to stderr)")
    b.set_defaults(func=_bench)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dsio`` console script; returns the exit status."""
    from .errors import DsioError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except CliError as e:
        print(f"dsio {args.command}: error: {e}", file=sys.stderr)
        return 1
    except (OSError, DsioError) as e:  # e.g. ENOSPC in the middle of a sweep: one line, no traceback
        print(f"dsio {args.command}: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"dsio {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
