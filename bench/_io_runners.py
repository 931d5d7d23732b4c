"""What bench/io.py's main table and its tuned sweep share: dsio's runner (one open handle per configuration),
DeepSpeed's baseline script, and the file helpers around a measured transfer (fsync, unlink, a
verified page-cache drop)."""

from __future__ import annotations

import asyncio
import os
import time

import torch

import dsio
from bench._common import drop_caches_verified

__all__ = ["COLD", "DS_SCRIPT", "DsioRunner", "drop", "fsync_path", "unlink"]

DS_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "baselines", "deepspeed_io.py")


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unlink(path: str) -> None:
    if os.path.exists(path):
        os.unlink(path)


COLD = {"ok": True}  # cleared by the first page-cache drop that fails or does not take


def drop(*paths: str) -> None:
    """Drop the page cache before a read and record whether it verifiably worked."""
    if not drop_caches_verified(*paths):
        COLD["ok"] = False


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
        drop(path)
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
        drop(path)
        out[f"ops_read_{k}"].append(self.run(via_file(False)))
        out[f"ops_write_{k}_path"].append(self.run(via_path(True)))
        drop(path)
        out[f"ops_read_{k}_path"].append(self.run(via_path(False)))

    def close(self) -> None:
        self.run(self.h.aclose())
