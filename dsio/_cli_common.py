"""What the ``dsio`` sub-commands share: argument types, `CliError`, the scratch-directory check, the
test buffer, the event loop a command runs on, sizes for humans. ``cli`` (the dispatcher), ``_tune``
and ``_report`` import it; it imports none of them."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
from typing import Any

__all__ = [
    "AIO_KEYS",
    "CliError",
    "backend_name",
    "buffer",
    "check_dir",
    "human",
    "list_of",
    "parse_size",
    "pos_int",
    "pow2_size",
    "run",
    "size_arg",
]

#: The keys of dstrain's ``"aio"`` config block that tune writes (dstrain/config_sections.py AioConfig).
AIO_KEYS = ("block_size", "queue_depth", "intra_op_parallelism", "single_submit", "overlap_events")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


class CliError(Exception):
    """A user-facing failure: printed as one line, exit status 1, no traceback."""


# -- argument types ------------------------------------------------------------------------------
def parse_size(text: str) -> int:
    """``"1G"``, ``"512M"``, ``"64KiB"``, ``"4096"`` -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", text)
    if not m:
        raise ValueError(f"not a size: {text!r} (use e.g. 4096, 64K, 512M, 1G)")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


def size_arg(text: str) -> int:
    try:
        n = parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if n <= 0 or n % 4096:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive multiple of 4096 bytes")
    return n


def pow2_size(text: str) -> int:
    n = size_arg(text)
    if n & (n - 1):
        raise argparse.ArgumentTypeError(f"{text!r} must be a power of two")
    return n


def list_of(conv: Any) -> Any:
    def parse(text: str) -> list[Any]:
        items = [t for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError("expected a comma-separated list")
        return [conv(t.strip()) for t in items]

    return parse


def pos_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def backend_name(text: str) -> str:
    if text not in ("io_uring", "aio", "posix"):
        raise argparse.ArgumentTypeError(f"unknown backend {text!r} (choose from io_uring, aio, posix)")
    return text


# -- the scratch directory and the test buffer ------------------------------------------------------------------------------
def check_dir(directory: str, need: int) -> str:
    d = os.path.abspath(directory)
    if not os.path.exists(d):
        raise CliError(f"directory {d} does not exist")
    if not os.path.isdir(d):
        raise CliError(f"{d} is not a directory")
    probe = os.path.join(d, f".dsio-probe-{os.getpid()}")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise CliError(f"cannot write to {d}: {e.strerror}") from None
    free = os.statvfs(d).f_bavail * os.statvfs(d).f_frsize
    if free < need:
        raise CliError(f"{d} has {human(free)} free; this run needs {human(need)} (lower --size)")
    return d


def buffer(nbytes: int, gpu: bool) -> Any:
    import torch

    from ._memory import locked_tensor

    t, _mem = locked_tensor(nbytes)  # the tensor keeps the buffer alive
    t.view(torch.int64)[: nbytes // 8].copy_(torch.arange(nbytes // 8, dtype=torch.int64))
    return t.cuda() if gpu else t


def run(coro: Any) -> Any:
    """Run a CLI coroutine on a fresh event loop: uvloop when importable (as every loop dsio
    starts), else asyncio's."""
    from ._bridge import new_loop

    with asyncio.Runner(loop_factory=new_loop) as runner:
        return runner.run(coro)


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" or n == int(n) else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
