"""fio baseline runner: one fio job, parsed from ``fio --output-format=json``.

Standard library only, so ``bench/io.py`` can import it from any interpreter::

    from bench.baselines.fio import fio_available, run_fio

    if fio_available():
        r = run_fio("/data/f", rw="write", size=1 << 30, block_size=1 << 20,
                    queue_depth=32, ioengine="libaio")
        r["gbps"], r["iops"], r["seconds"]

Semantics, so the numbers compare with dsio's and DeepSpeed's:

* Writes run with ``end_fsync=1`` by default: fio fsyncs the file after the last write and
  its reported runtime (hence ``gbps``/``iops``/``seconds``) includes that fsync, i.e.
  these are *durable* writes, comparable to "write + fsync" of the other methods. Pass
  ``end_fsync=False`` to compare with writes that are not flushed (small-op rates).
* ``direct=True`` (default) opens with O_DIRECT, like DeepSpeed's aio_handle.
* A new file is written into fresh blocks: ``fallocate="none"`` (the default here,
  fio's own default is to preallocate) so fio does not reserve the blocks before
  the timed run. Delete the file first for the "new file" case; leave it for
  "overwrite". Pass ``fallocate="native"`` to get fio's default behaviour.
* Reads need an existing file of at least ``size`` bytes (fio would otherwise lay
  one out itself, untimed). Drop caches before reads if you want them cold.
* Small-op rate: ``size=2000 * bs`` with ``rw="randwrite"``/``"randread"`` (or
  ``"write"``/``"read"``) issues 2,000 ops of ``bs`` each (every block exactly once,
  fio's random map), or pass ``runtime_ops=N`` to stop after N ops (fio
  ``number_ios``). Read ``iops`` from the result.
* ``gbps`` is decimal: bytes / seconds / 1e9. fio reports runtime in whole
  milliseconds, so keep jobs >= ~100 ms (1 GiB, or 2,000 ops) for ~1% resolution.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time

__all__ = ["fio_available", "ioengine_available", "run_fio"]

_RW = ("write", "read", "randwrite", "randread")
_ENGINES = ("libaio", "io_uring")


def fio_available() -> bool:
    """True if a working ``fio`` binary is on PATH."""
    exe = shutil.which("fio")
    if exe is None:
        return False
    try:
        proc = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    return proc.returncode == 0


def ioengine_available(ioengine: str, directory: str | None = None) -> bool:
    """True if fio can run a tiny job with ``ioengine`` (io_uring may be disabled by sysctl)."""
    if not fio_available():
        return False
    with tempfile.TemporaryDirectory(dir=directory) as d:
        path = os.path.join(d, "probe.bin")
        try:
            run_fio(
                path,
                rw="write",
                size=1 << 20,
                block_size=1 << 16,
                queue_depth=1,
                ioengine=ioengine,
                direct=False,
            )
        except (RuntimeError, ValueError):
            return False
    return True


def run_fio(
    path: str,
    *,
    rw: str,
    size: int,
    block_size: int,
    queue_depth: int,
    ioengine: str,
    direct: bool = True,
    runtime_ops: int | None = None,
    fallocate: str = "none",
    end_fsync: bool = True,
    timeout_s: float = 600.0,
) -> dict:
    """Run one fio job on ``path`` and return its throughput.

    Args:
        path: the file to write or read.
        rw: "write" | "read" | "randwrite" | "randread".
        size: bytes of the file region the job covers.
        block_size: bytes per I/O (fio ``bs``).
        queue_depth: fio ``iodepth``.
        ioengine: "libaio" | "io_uring".
        direct: O_DIRECT (default True).
        runtime_ops: stop after this many I/Os (fio ``number_ios``); default: all of ``size``.
        fallocate: fio ``fallocate`` mode; "none" (default) leaves a new file unallocated.
        end_fsync: writes end with an fsync included in the runtime (default). False for
            comparisons with writes that are not flushed (dsio's and DeepSpeed's small ops).
        timeout_s: kill fio after this long.

    Returns:
        {"gbps": decimal GB/s, "iops": ops/s, "seconds": fio's runtime (includes the
        end fsync for writes), "bytes": bytes transferred, "ops": I/Os done,
        "wall_seconds": the fio process's wall time, incl. start-up, "rw", "ioengine",
        "block_size", "queue_depth", "fio_version"}.

    Raises:
        ValueError: a bad argument.
        RuntimeError: fio is missing, fails, or its output cannot be parsed.
    """
    if rw not in _RW:
        raise ValueError(f"rw must be one of {_RW}, got {rw!r}")
    if ioengine not in _ENGINES:
        raise ValueError(f"ioengine must be one of {_ENGINES}, got {ioengine!r}")
    if size <= 0 or block_size <= 0 or queue_depth <= 0:
        raise ValueError("size, block_size and queue_depth must be positive")
    if runtime_ops is not None and runtime_ops <= 0:
        raise ValueError("runtime_ops must be positive or None")
    exe = shutil.which("fio")
    if exe is None:
        raise RuntimeError("fio not found on PATH (apt-get install fio)")

    is_write = rw in ("write", "randwrite")
    with tempfile.NamedTemporaryFile("r", suffix=".json", delete=False) as out:
        out_path = out.name
    cmd = [
        exe,
        "--name=dsio-baseline",
        f"--filename={path}",
        f"--rw={rw}",
        f"--bs={block_size}",
        f"--size={size}",
        f"--iodepth={queue_depth}",
        f"--ioengine={ioengine}",
        f"--direct={1 if direct else 0}",
        f"--fallocate={fallocate}",
        "--numjobs=1",
        "--thread",
        "--output-format=json",
        f"--output={out_path}",
    ]
    if is_write and end_fsync:
        cmd.append("--end_fsync=1")
    if runtime_ops is not None:
        cmd.append(f"--number_ios={runtime_ops}")
    try:
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"fio timed out after {timeout_s}s: {' '.join(cmd)}") from e
        wall = time.perf_counter() - t0
        with open(out_path) as f:
            text = f.read()
    finally:
        with contextlib.suppress(OSError):
            os.unlink(out_path)
    if proc.returncode != 0:
        raise RuntimeError(
            f"fio exited {proc.returncode}: {' '.join(cmd)}\n{proc.stderr.strip()}\n{text[-2000:]}"
        )
    start = text.find("{")  # fio may print warnings before the JSON
    try:
        data = json.loads(text[start:])
        job = data["jobs"][0]
        stats = job["write" if is_write else "read"]
    except (ValueError, KeyError, IndexError) as e:
        raise RuntimeError(f"cannot parse fio output: {text[:2000]}") from e
    if job.get("error"):
        raise RuntimeError(f"fio job error {job['error']}: {' '.join(cmd)}")
    seconds = stats["runtime"] / 1e3  # ms, includes end_fsync for writes
    nbytes = int(stats["io_bytes"])
    ops = int(stats["total_ios"])
    if seconds <= 0 or nbytes <= 0:
        raise RuntimeError(
            f"fio did no measurable I/O (runtime {seconds}s, {nbytes} bytes; runtime has 1 ms resolution)"
        )
    return {
        "gbps": nbytes / seconds / 1e9,
        "iops": ops / seconds,
        "seconds": seconds,
        "bytes": nbytes,
        "ops": ops,
        "wall_seconds": wall,
        "rw": rw,
        "ioengine": ioengine,
        "block_size": block_size,
        "queue_depth": queue_depth,
        "fio_version": data.get("fio version"),
    }


if __name__ == "__main__":  # tiny CLI for manual checks
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--path", required=True)
    p.add_argument("--rw", choices=_RW, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--block-size", type=int, default=1 << 20)
    p.add_argument("--queue-depth", type=int, default=32)
    p.add_argument("--ioengine", choices=_ENGINES, default="libaio")
    p.add_argument("--buffered", action="store_true", help="no O_DIRECT")
    p.add_argument("--ops", type=int, default=None)
    a = p.parse_args()
    print(
        json.dumps(
            run_fio(
                a.path,
                rw=a.rw,
                size=a.size,
                block_size=a.block_size,
                queue_depth=a.queue_depth,
                ioengine=a.ioengine,
                direct=not a.buffered,
                runtime_ops=a.ops,
            )
        )
    )
