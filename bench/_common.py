"""Shared bench helpers: machine description, cache dropping, this process's RSS, medians, result files."""

from __future__ import annotations

import ctypes
import datetime as _dt
import json
import mmap
import os
import platform
import socket
import statistics
import subprocess
import sys

#: Where drivers write their result files: ``$DSIO_BENCH_RESULTS`` (``make bench``'s quick runs point it
#: under build/, so they never mix with the committed results), else bench/results.
RESULTS = os.environ.get("DSIO_BENCH_RESULTS") or os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "results"
)
#: The checkout: benchmark defaults live under it, never at a machine-specific path.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def scratch_dir() -> str:
    """Where benchmarks put their files: ``$DSIO_BENCH_DIR``, else ``<checkout>/.bench-tmp``.
    It must be on the disk being measured (O_DIRECT-capable: not tmpfs)."""
    return os.environ.get("DSIO_BENCH_DIR") or os.path.join(ROOT, ".bench-tmp")


def deepspeed_venv() -> str:
    """The DeepSpeed reference venv: ``$DSIO_DEEPSPEED_VENV``, else ``<checkout>/.venv-deepspeed``
    (what ``bench/baselines/setup_deepspeed.sh`` creates by default)."""
    return os.environ.get("DSIO_DEEPSPEED_VENV") or os.path.join(ROOT, ".venv-deepspeed")


def deepspeed_python(explicit: str | None = None) -> str | None:
    """The DeepSpeed venv's interpreter, or None (after saying why and how to get one) when missing.

    Order: ``explicit`` (a --ds-python flag), ``$DSIO_DEEPSPEED_PYTHON``, ``deepspeed_venv()/bin/python``."""
    py = (
        explicit or os.environ.get("DSIO_DEEPSPEED_PYTHON") or os.path.join(deepspeed_venv(), "bin", "python")
    )
    if os.path.exists(py):
        return py
    print(
        f"bench: DeepSpeed baseline skipped: {py} does not exist. Build it with "
        "`bash bench/baselines/setup_deepspeed.sh` (default venv <checkout>/.venv-deepspeed), or point "
        "DSIO_DEEPSPEED_VENV / DSIO_DEEPSPEED_PYTHON at an existing one.",
        file=sys.stderr,
    )
    return None


def drop_caches() -> bool:
    """Drop the page cache (root only). Returns whether it worked."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def resident_fraction(path: str, offset: int = 0, nbytes: int | None = None) -> float:
    """Fraction of the file's pages in [offset, offset+nbytes) held in the page cache (mincore)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        start = offset & ~(mmap.PAGESIZE - 1)
        end = size if nbytes is None else min(size, offset + nbytes)
        if end <= start:
            return 0.0
        length = end - start
        addr = _libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap for mincore failed")
        try:
            pages = (length + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vec = (ctypes.c_ubyte * pages)()
            if _libc.mincore(addr, length, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
            return sum(v & 1 for v in bytes(vec)) / pages
        finally:
            _libc.munmap(addr, length)
    finally:
        os.close(fd)


def drop_caches_verified(*paths: str, max_resident: float = 0.01) -> bool:
    """Drop the page cache and check with mincore that none of ``paths`` is still cached.

    False when the drop was refused (not root) or did not take (more than ``max_resident`` of
    a file still resident): the caller must then label its reads warm, not cold.
    """
    if not drop_caches():
        return False
    return all(resident_fraction(p) <= max_resident for p in paths if os.path.exists(p))


# -- this process's memory (Linux /proc): what every driver's peak-RSS figure reads ---------------------


def rss() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in bytes: resident now, and the peak since the process started
    or since the last `reset_peak` (``/proc/self/status``)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                k, v = line.split(":")
                out[k] = int(v.split()[0]) * 1024
    return out["VmRSS"], out["VmHWM"]


def rss_now() -> int:
    """VmRSS alone in bytes, from ``/proc/self/statm``: a quarter of `rss`'s cost (14 vs 55 us a read
    here), for a thread that samples it every millisecond."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak(*, required: bool = False) -> bool:
    """Reset VmHWM to the current RSS (``/proc/self/clear_refs``, Linux >= 4.0); False where the kernel
    refuses, or with ``required`` an ``OSError`` (a driver whose peak would otherwise include what it
    meant to leave out, e.g. building the model)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        if required:
            raise
        return False


def machine() -> dict[str, str]:
    def sh(cmd: str) -> str:
        try:
            return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=10).stdout.strip()
        except Exception:
            return "?"

    cpu = sh("grep -m1 'model name' /proc/cpuinfo | cut -d: -f2").strip()
    return {
        "host": socket.gethostname(),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "kernel": platform.release(),
        "cpu": f"{os.cpu_count()} x {cpu}",
        "memory": sh("free -g | awk '/Mem:/{print $2\" GiB\"}'"),
        "python": platform.python_version(),
    }


def fs_of(path: str) -> str:
    out = subprocess.run(["df", "-T", path], capture_output=True, text=True).stdout.splitlines()
    return " ".join(out[-1].split()[:2]) if out else "?"


def summarize(xs: list[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    return statistics.median(xs), min(xs), max(xs)


def fmt(xs: list[float], digits: int = 2) -> str:
    if not xs:
        return "-"
    m, lo, hi = summarize(xs)
    if digits == 0:
        return f"{m:,.0f} ({lo:,.0f}-{hi:,.0f})"
    return f"{m:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})"


def result_path(kind: str, ext: str = "md") -> str:
    day = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    os.makedirs(RESULTS, exist_ok=True)
    return os.path.join(RESULTS, f"{day}-{socket.gethostname()}-{kind}.{ext}")


def write_labelled_result(kind: str, label: str, meta: dict, md: str, payload: dict) -> str:
    """Write ``bench/results/<kind>[-<label>]-<day>.md`` and ``.json`` (``{"meta": meta, **payload}``),
    print the report, and return the stem."""
    day = meta["date"].split()[0]
    stem = os.path.join(RESULTS, kind + (f"-{label}" if label else "") + f"-{day}")
    with open(stem + ".md", "w") as f:
        f.write(md)
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, **payload}, f, indent=1)
    print(md)
    print(f"written: {stem}.md (+ .json)")
    return stem
