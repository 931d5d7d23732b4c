"""Shared bench helpers: machine description, cache dropping, medians, result files."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import socket
import statistics
import subprocess

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def drop_caches() -> bool:
    """Drop the page cache (root only). Returns whether it worked."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
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
