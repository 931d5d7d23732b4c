"""CUDA tensors: GPUDirect Storage (cuFile) or pipelined pinned bounce buffers.

``IOConfig.gpu_backend``:

- ``"cufile"``: cuFileRead / cuFileWrite on registered fds, run by a dedicated engine
  (``intra_op_parallelism`` workers, libcufile loaded with dlopen). Where the nvidia-fs kernel
  module is missing, cuFile runs in compat mode (its own POSIX path through host memory).
- ``"bounce"``: chunks go through the handle's ``PinnedPool`` (registered with CUDA): a
  device->host copy on a side stream, then an O_DIRECT write (reads: the reverse), chunk after
  chunk, so copies overlap the disk. Copy completion reaches the event loop through a CUDA host
  callback (cuLaunchHostFunc) that writes the engine's eventfd: no thread waits per operation.
- ``"auto"``: cuFile when true GDS is available (nvidia-fs loaded), else the bounce path, which
  measured faster than cuFile's compat mode on our H200 machine (bench/results, gpu_io).
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ._dispatch import READ, WRITE, Dispatcher
from ._gather import started
from ._native import native
from ._transfer import FileRef, fsync, transfer
from .config import ALIGNMENT
from .errors import BackendUnavailableError

if TYPE_CHECKING:
    from ._op import Operations

__all__ = ["GpuStatus", "GpuIO", "gpu_status"]


@dataclass(frozen=True, slots=True)
class GpuStatus:
    cuda: bool
    """torch sees a CUDA device."""
    driver: str
    """CUDA driver status ("ok" or why not)."""
    cufile: bool
    """libcufile loaded and its driver opened."""
    cufile_reason: str
    nvidia_fs: bool
    """The nvidia-fs kernel module is loaded (true GPUDirect); without it cuFile runs in compat mode."""
    auto_choice: str
    """What ``gpu_backend="auto"`` picks here, and why."""


def gpu_status() -> GpuStatus:
    C = native()
    cuda = torch.cuda.is_available()
    ok, derr = C.cuda_driver_status() if cuda else (False, "torch sees no CUDA device")
    cf_ok, cf_err, nvfs = C.cufile_status() if ok else (False, "no CUDA driver", False)
    if cf_ok and nvfs:
        choice = "cufile (GPUDirect Storage: nvidia-fs loaded)"
    elif cuda:
        why = (
            "cuFile would run in compat mode (no nvidia-fs module)"
            if cf_ok
            else f"cuFile unavailable: {cf_err}"
        )
        choice = f"bounce ({why}; pipelined pinned buffers measured faster)"
    else:
        choice = "none (no CUDA)"
    return GpuStatus(cuda, "ok" if ok else derr, cf_ok, "" if cf_ok else cf_err, nvfs, choice)


class GpuIO:
    """The CUDA half of an ``AsyncIOHandle``; created on the first CUDA tensor it sees."""

    def __init__(self, ops: Operations) -> None:
        if not torch.cuda.is_available():
            raise BackendUnavailableError("a CUDA tensor was given but torch sees no CUDA device here")
        self._ops = ops
        self._C = native()
        st = gpu_status()
        if st.driver != "ok":
            raise BackendUnavailableError(f"CUDA driver unavailable: {st.driver}")
        want = ops.config.gpu_backend
        if want == "cufile" and not st.cufile:
            raise BackendUnavailableError(
                f"gpu_backend='cufile' but libcufile is unusable: {st.cufile_reason}"
            )
        self.backend = (
            "cufile" if want == "cufile" or (want == "auto" and st.cufile and st.nvidia_fs) else "bounce"
        )
        self.compat_mode = self.backend == "cufile" and not st.nvidia_fs
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._cudisp: Dispatcher | None = None
        if self.backend == "cufile":
            from ._backends import open_engine

            eng = open_engine(ops.config, backend="cufile")
            self._cudisp = Dispatcher(eng)
        self.bytes = {"bounce": 0, "cufile": 0}

    # -- public entry points (called by AsyncIOHandle / AsyncFile) -------------------------------
    async def pwrite(
        self, tensor: torch.Tensor, path: Any, offset: int | None, *, fsync: bool = False
    ) -> int:
        from ._tensor import check_range

        flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if offset is None else 0)
        off = 0 if offset is None else check_range(offset, tensor.nbytes, path=path)
        ref = FileRef(os.fspath(path), flags, o_direct=self._ops.config.o_direct)
        try:
            if offset is None and tensor.nbytes:
                os.ftruncate(ref.fd, tensor.nbytes)
            await self._io(WRITE, ref, tensor, off)
            if fsync:
                await self._fsync(ref)
        finally:
            ref.release()
        return tensor.nbytes

    async def pread(self, tensor: torch.Tensor, path: Any, offset: int = 0) -> int:
        from ._tensor import check_range
        from ._transfer import check_readable

        ref = FileRef(os.fspath(path), os.O_RDONLY, o_direct=self._ops.config.o_direct)
        try:
            check_readable(ref, tensor.nbytes, check_range(offset, tensor.nbytes))
            await self._io(READ, ref, tensor, offset)
        finally:
            ref.release()
        return tensor.nbytes

    async def pwrite_file(self, ref: FileRef, tensor: torch.Tensor, offset: int) -> int:
        """Write at ``offset`` of an open file (``AsyncFile``'s ``ref``)."""
        await self._io(WRITE, ref, tensor, offset)
        return tensor.nbytes

    async def pread_file(self, ref: FileRef, tensor: torch.Tensor, offset: int) -> int:
        """Read from ``offset`` of an open file (``AsyncFile``'s ``ref``)."""
        from ._transfer import check_readable

        check_readable(ref, tensor.nbytes, offset)
        await self._io(READ, ref, tensor, offset)
        return tensor.nbytes

    # -- paths -------------------------------------------------------------------------------------
    async def _io(self, op: int, ref: FileRef, tensor: torch.Tensor, offset: int) -> None:
        n = tensor.nbytes
        if n == 0:
            return
        h = self._ops
        h.begin()
        ok = False
        try:
            if self.backend == "cufile":
                await self._cufile(op, ref, tensor, offset)
            else:
                await self._bounce(op, ref, tensor, offset)
            self.bytes[self.backend] += n
            ok = True
        finally:
            h.end(op, n, ok)

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        idx = device.index if device.index is not None else torch.cuda.current_device()
        s = self._streams.get(idx)
        if s is None:
            s = self._streams[idx] = torch.cuda.Stream(device=idx)
        return s

    async def _after(self, disp: Dispatcher, stream: torch.cuda.Stream) -> None:
        await disp.after_stream(stream.cuda_stream)

    async def _cufile(self, op: int, ref: FileRef, tensor: torch.Tensor, offset: int) -> None:
        disp = self._cudisp
        assert disp is not None
        rc = self._C.cufile_register(ref.fd)
        if rc != 0:
            code = -rc - 1000 if rc <= -1000 else rc
            raise BackendUnavailableError(
                f"cuFileHandleRegister failed for {ref.path}: CUfileOpError {code} "
                "(cuFile could not set up this file's filesystem; its cufile.log says why). "
                "gpu_backend='bounce' works everywhere."
            )
        if self._C.cufile_deregister not in ref.on_close:
            ref.on_close.append(self._C.cufile_deregister)
        # cuFile reads device memory synchronously: let the producing stream finish first.
        await self._after(disp, torch.cuda.current_stream(tensor.device))
        ref.acquire()
        try:
            fut = disp.submit(
                op,
                ref.fd,
                tensor.data_ptr(),
                tensor.nbytes,
                offset,
                path=ref.path,
                finalize=ref.done,
                keep=tensor,
            )
        except BaseException:
            ref.release()
            raise
        await fut

    async def _bounce(self, op: int, ref: FileRef, tensor: torch.Tensor, offset: int) -> None:
        h = self._ops
        pool, disp = h.pool, h.disp
        stream = self._stream(tensor.device)
        flat = tensor.reshape(-1).view(torch.uint8)
        n = flat.numel()
        if op == WRITE:
            stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the data must be produced
        # A failed chunk stops the chunks from starting; those started all end (their copies and
        # I/O use the pool's buffers and the tensor) before this returns or raises the first error.
        async with started() as work:
            pos = 0
            while pos < n:
                if work.failed:
                    break
                phase = (offset + pos) % ALIGNMENT  # keep buffer and file in the same 4 KiB phase
                size = min(n - pos, pool.buffer_bytes - phase)
                lease = await pool.acquire()
                view = lease.tensor[phase : phase + size]
                chunk = flat[pos : pos + size]
                if op == WRITE:
                    with torch.cuda.stream(stream):
                        view.copy_(chunk, non_blocking=True)
                    copied = disp.after_stream(stream.cuda_stream)
                    work.start(self._chunk_write(copied, lease, phase, size, offset + pos, ref))
                else:
                    work.start(self._chunk_read(lease, phase, size, offset + pos, ref, chunk, stream))
                pos += size

    async def _chunk_write(
        self, copied: asyncio.Future, lease: Any, phase: int, size: int, off: int, ref: FileRef
    ) -> None:
        h = self._ops
        try:
            await copied
            await transfer(h.disp, h.pool, ref, WRITE, lease.ptr + phase, size, off, lease, h.counters)
        finally:
            lease.release()

    async def _chunk_read(
        self,
        lease: Any,
        phase: int,
        size: int,
        off: int,
        ref: FileRef,
        chunk: torch.Tensor,
        stream: torch.cuda.Stream,
    ) -> None:
        h = self._ops
        try:
            await transfer(h.disp, h.pool, ref, READ, lease.ptr + phase, size, off, lease, h.counters)
            with torch.cuda.stream(stream):
                chunk.copy_(lease.tensor[phase : phase + size], non_blocking=True)
            await h.disp.after_stream(stream.cuda_stream)
        finally:
            lease.release()

    async def _fsync(self, ref: FileRef) -> None:
        await fsync(self._ops.disp, ref)

    def close(self) -> None:
        if self._cudisp is not None:
            self._cudisp.shutdown()
            self._cudisp.engine.close()
            self._cudisp = None
