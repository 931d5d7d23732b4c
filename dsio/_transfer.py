"""How one tensor transfer is cut up and sent: the policy half of the data path.

A transfer of ``nbytes`` at file offset ``offset`` on an O_DIRECT file becomes

    head  [offset, align_up(offset))            buffered fd (unaligned file offset)
    body  [align_up(offset), align_down(end))   O_DIRECT, straight from the tensor when its memory
                                                is 4096-aligned (and, for a large read, already
                                                faulted in: see ``SWITCHES.fresh_staged``), else staged chunk by chunk through
                                                PinnedPool buffers, pipelined with the disk (a
                                                staging copy, pool <-> tensor, runs in the
                                                engine's worker threads, piece by piece, GIL-free)
    tail  [align_down(end), end)                buffered fd (unaligned length)

so any size, any address and any offset work and files end exactly at ``end``. Where the
filesystem refuses O_DIRECT the whole transfer is one buffered request.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os
from collections.abc import Callable

from ._backends import warn_once
from ._dispatch import FSYNC, READ, Dispatcher
from ._gather import wait_all
from ._memory import memcpy
from ._tuning import SWITCHES  # the core loads on first use, not at import
from .config import ALIGNMENT
from .errors import ClosedError, ShortIOError
from .pool import Lease, PinnedPool

__all__ = [
    "PREFAULT_MIN_BYTES",
    "FileRef",
    "TransferCounters",
    "cancel_prefault",
    "check_readable",
    "fsync",
    "prefault",
    "read_fresh",
    "submit_one",
    "transfer",
    "whole_route",
]

#: Reads of at least this many bytes have their destination populated ahead of the I/O by the
#: engine's prefault thread (MADV_POPULATE_WRITE), so first-touch page faults on fresh memory
#: (``torch.empty``) overlap the disk instead of stalling the submitter or the staging copies.
#: Already-resident memory costs two mincore probes per 2 MiB.
PREFAULT_MIN_BYTES = 4 << 20


_PAGE = os.sysconf("SC_PAGE_SIZE")
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))


def fresh(ptr: int, nbytes: int) -> bool:
    """Whether ``[ptr, ptr + nbytes)`` looks never touched: its first, middle and last pages are
    all mapped and none is resident (mincore). False for anything else, e.g. unmapped memory."""
    vec = (ctypes.c_ubyte * 1)()
    last = ptr + nbytes - 1
    for addr in (ptr, ptr + nbytes // 2, last):
        page = addr - addr % _PAGE
        if _libc.mincore(page, _PAGE, vec) != 0 or vec[0] & 1:
            return False
    return True


DIRECT, FRESH, SPLIT = "direct", "fresh", "split"
"""The routes of a whole request (`whole_route`)."""


def whole_route(ref: FileRef, op: int, ptr: int, nbytes: int, offset: int) -> str:
    """How a whole request goes, decided once (the one place that decides "direct or not"):
    ``DIRECT``, one O_DIRECT request (memory, offset and length 4096-aligned); ``FRESH``, aligned
    but a large read into fresh memory, staged (``SWITCHES.fresh_staged``): `transfer` is told so
    (``fresh=True``) and does not probe again; ``SPLIT``, for `transfer` to split (unaligned,
    buffered or empty)."""
    if not ref.direct or nbytes == 0 or (ptr | offset | nbytes) & (ALIGNMENT - 1):
        return SPLIT
    return FRESH if read_fresh(op, ptr, nbytes) else DIRECT


def read_fresh(op: int, ptr: int, nbytes: int) -> bool:
    """A large read into fresh page-aligned memory, to be staged (``SWITCHES.fresh_staged``)."""
    return SWITCHES.fresh_staged and op == READ and nbytes >= PREFAULT_MIN_BYTES and fresh(ptr, nbytes)


def prefault(disp: Dispatcher, op: int, ptr: int, nbytes: int, *, direct: bool = False) -> int:
    """Start populating a read's destination ahead of the I/O; a token for ``cancel_prefault``
    (0 when nothing was queued: a write, a small read, or a kernel without MADV_POPULATE_WRITE).

    ``direct``: the kernel reads straight into this memory. The engine's workers then fault in
    the first window they submit (block_size x queue_depth x workers) themselves, at once, so
    the prefault thread starts past it instead of racing them over the same pages; and fresh whole
    2 MiB steps are advised MADV_HUGEPAGE before being populated (one fault per 2 MiB instead of
    512: a fresh page-aligned 512 MiB destination read 1.18x vs 0.70x DeepSpeed's locked read with
    vs without it, 5 interleaved reps under load; staged reads showed no gain, so they do not).
    """
    if op != READ or nbytes < PREFAULT_MIN_BYTES:
        return 0
    skip = min(nbytes, int(disp.engine.window_bytes)) if direct else 0
    if nbytes - skip < ALIGNMENT:
        return 0
    return int(disp.engine.prefault(ptr + skip, nbytes - skip, direct))


def cancel_prefault(disp: Dispatcher, token: int) -> None:
    """The read is over (done, failed or cancelled): stop populating its destination."""
    if token:
        disp.engine.prefault_cancel(token)


class FileRef:
    """The fds of one open file, shared by the requests using it; closed when the last one is done.

    The engine carves pieces lazily, so an fd must outlive every request that names it: closing
    it early could let a later ``open()`` reuse the number and receive someone else's data.
    """

    def __init__(self, path: str, flags: int, *, o_direct: bool, mode: int = 0o644) -> None:
        self.path = os.fspath(path)
        self.direct = False
        self._access = flags & os.O_ACCMODE
        fd = -1
        if o_direct:
            try:
                fd = os.open(self.path, flags | os.O_DIRECT | os.O_CLOEXEC, mode)
                self.direct = True
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                dev = os.path.dirname(os.path.abspath(self.path))
                warn_once("odirect:" + dev, f"dsio: O_DIRECT not supported under {dev}; using buffered I/O")
        if fd < 0:
            fd = os.open(self.path, flags | os.O_CLOEXEC, mode)
        self.fd = fd
        self._buffered = -1 if self.direct else fd
        self._refs = 1
        self.on_close: list[Callable[[int], None]] = []
        """Called with the fd just before it closes (e.g. cuFile deregistration)."""

    def buffered_fd(self) -> int:
        """An fd without O_DIRECT on the same inode (opened once, through /proc, rename-proof)."""
        if self._buffered < 0:
            self._buffered = os.open(f"/proc/self/fd/{self.fd}", self._access | os.O_CLOEXEC)
        return self._buffered

    def acquire(self) -> FileRef:
        if self._refs <= 0:
            raise ClosedError(f"file {self.path} is closed")
        self._refs += 1
        return self

    def release(self) -> None:
        self._refs -= 1
        if self._refs == 0:
            for hook in self.on_close:
                hook(self.fd)
            if self._buffered >= 0 and self._buffered != self.fd:
                os.close(self._buffered)
            os.close(self.fd)
            self.fd = self._buffered = -1

    def done(self, _result: int) -> None:
        """Finalizer of a request on this file: drop its reference."""
        self.release()


class TransferCounters:
    """Bytes by route, for statistics(): direct from caller memory, staged, buffered."""

    __slots__ = ("direct", "staged", "buffered")

    def __init__(self) -> None:
        self.direct = self.staged = self.buffered = 0


def _align_up(n: int) -> int:
    return (n + ALIGNMENT - 1) & ~(ALIGNMENT - 1)


def _align_down(n: int) -> int:
    return n & ~(ALIGNMENT - 1)


async def transfer(
    disp: Dispatcher,
    pool: PinnedPool,
    ref: FileRef,
    op: int,
    ptr: int,
    nbytes: int,
    offset: int,
    keep: object,
    counters: TransferCounters,
    *,
    fresh: bool | None = None,
    sums: tuple[int, int, int] = (0, 0, 0),
) -> None:
    """Move ``nbytes`` between memory at ``ptr`` and ``ref`` at ``offset``; raise if any part fails.

    ``sums`` (reads): `dsio._sums.ReadSums.engine_args`, given to every request of the transfer
    (the fragments are file offsets, so each request checksums those inside its own pieces).

    ``fresh``: `whole_route` already found this whole aligned request a read into fresh memory
    (True) or not (False); None (unaligned requests, the GPU path's buffers): `transfer` probes the
    aligned body itself.

    Returns or raises only when every request it submitted has finished (``_gather.wait_all``
    with ``drain``): after a failed piece, a refused submission or the caller's cancellation,
    nothing of it is still reading into or writing from the caller's memory.
    """
    if nbytes == 0:
        return
    end = offset + nbytes
    if not ref.direct:
        counters.buffered += nbytes
        await submit_one(disp, ref, op, ptr, nbytes, offset, keep, sums=sums)
        return
    body_start = min(_align_up(offset), end)
    body_end = max(_align_down(end), body_start)
    body_ptr = ptr + (body_start - offset)
    if fresh is None:
        fresh = body_ptr % ALIGNMENT == 0 and read_fresh(op, body_ptr, body_end - body_start)
    fresh_dst = fresh
    # (a wholly aligned request that is not fresh is one O_DIRECT request that handles submit
    # without this coroutine: `whole_route`, asked once by dsio._op.Operations.start)

    futs: list[asyncio.Future] = []
    failed: list[asyncio.Future] = []

    def note(f: asyncio.Future) -> None:
        if not f.cancelled() and f.exception() is not None:
            failed.append(f)

    def submit(
        fd: int, p: int, n: int, off: int, finalize: Callable[[int], None] | None, stage_of: int = 0
    ) -> None:
        ref.acquire()
        fin = ref.done if finalize is None else _then_release(finalize, ref)
        dst, src = (stage_of, 0) if op == READ else (0, stage_of)
        try:
            f = disp.submit(
                op,
                fd,
                p,
                n,
                off,
                path=ref.path,
                finalize=fin,
                keep=keep,
                copy_dst=dst,
                copy_src=src,
                sums=sums,
            )
        except BaseException:
            fin(-errno.ECANCELED)  # never reached the engine: give back the ref and any lease now
            raise
        f.add_done_callback(note)
        futs.append(f)

    # A large read's destination is populated ahead of the I/O and of the staging copies.
    body_len = body_end - body_start
    direct = bool(body_len) and body_ptr % ALIGNMENT == 0 and not fresh_dst
    token = prefault(disp, op, ptr, nbytes, direct=direct)
    stopped: BaseException | None = None  # what ended the submissions early, if anything
    try:
        try:
            if body_start > offset:
                submit(ref.buffered_fd(), ptr, body_start - offset, offset, None)
            if end > body_end:
                submit(ref.buffered_fd(), ptr + (body_end - offset), end - body_end, body_end, None)
            counters.buffered += nbytes - body_len
            if direct:
                submit(ref.fd, body_ptr, body_len, body_start, None)
                counters.direct += body_len
            elif (
                body_len
                and SWITCHES.ring_staging
                and op == READ
                and not SWITCHES.loop_thread_copy
                and _ring_ok(disp, pool)
            ):
                await _staged_ring(disp, pool, ref, op, body_ptr, body_len, body_start, keep, futs, sums)
                counters.staged += body_len
            elif body_len:
                await _staged(submit, pool, op, ref.fd, body_ptr, body_len, body_start, failed)
                counters.staged += body_len
        except BaseException as e:  # a refused submission, or the caller cancelled mid-way
            stopped = e
        # Whatever happened, every request already in the kernel is waited for (kernel I/O cannot
        # be recalled: returning earlier would leave it reading into or writing from the caller's
        # memory after the call ended).
        try:
            await wait_all(futs, drain=True)  # a cancellation arriving now propagates after it
        except Exception:
            if stopped is None or isinstance(stopped, Exception):
                raise  # a request failed before the submissions stopped: the first error in order
            # else the caller was cancelled mid-submission: that cancellation propagates below
        if stopped is not None:
            raise stopped
    finally:
        cancel_prefault(disp, token)


def submit_one(
    disp: Dispatcher,
    ref: FileRef,
    op: int,
    ptr: int,
    n: int,
    off: int,
    keep: object,
    *,
    sums: tuple[int, int, int] = (0, 0, 0),
) -> asyncio.Future:
    """One request on ``ref.fd``, holding a reference to the file until the kernel is done.

    A large read first queues its destination for prefaulting, cancelled when the kernel is done.
    ``sums``: as `transfer`'s."""
    ref.acquire()
    token = prefault(disp, op, ptr, n, direct=True)
    fin = ref.done if not token else _then_release(lambda _res: cancel_prefault(disp, token), ref)
    try:
        return disp.submit(op, ref.fd, ptr, n, off, path=ref.path, finalize=fin, keep=keep, sums=sums)
    except BaseException:
        cancel_prefault(disp, token)
        ref.release()
        raise


def _then_release(finalize: Callable[[int], None], ref: FileRef) -> Callable[[int], None]:
    def fin(res: int) -> None:
        try:
            finalize(res)
        finally:
            ref.release()

    return fin


async def _staged(
    submit, pool: PinnedPool, op: int, fd: int, ptr: int, n: int, off: int, failed: list
) -> None:
    """Pipeline: each chunk takes a pool buffer (waiting when none is free), so staging the next
    chunk overlaps the disk I/O of the previous ones. Stops early once any request failed.

    The staging copies happen in the engine's workers, piece by piece, GIL-free, never on the
    event-loop thread: a read's pool -> tensor copy (``copy_dst``) by the worker that reaped the
    piece, while the chunk's other pieces are still in flight; a write's tensor -> pool copy
    (``copy_src``) by the worker about to submit the piece. The lease is released only after the
    request (copies included) completed."""
    chunk = pool.buffer_bytes
    pos = 0
    while pos < n and not failed:
        size = min(chunk, n - pos)
        lease = await pool.acquire()
        if not SWITCHES.loop_thread_copy:
            submit(fd, lease.ptr, size, off + pos, _releaser(lease), ptr + pos)
        elif op == READ:
            submit(fd, lease.ptr, size, off + pos, _loop_copier(lease, ptr + pos, size))
        else:
            memcpy(lease.ptr, ptr + pos, size)
            submit(fd, lease.ptr, size, off + pos, _releaser(lease))
        pos += size


def _ring_ok(disp: Dispatcher, pool: PinnedPool) -> bool:
    """The pool's buffers hold whole pieces (a slot per block_size)."""
    return pool.buffer_bytes >= int(disp.engine.block_size)


async def _staged_ring(
    disp: Dispatcher,
    pool: PinnedPool,
    ref: FileRef,
    op: int,
    ptr: int,
    n: int,
    off: int,
    keep: object,
    futs: list[asyncio.Future],
    sums: tuple[int, int, int] = (0, 0, 0),
) -> None:
    """A staged read's body as one engine request: take one pool buffer (waiting if none is free)
    and every other free one the transfer can use, cut them into block_size slots, and let the
    workers stream the whole body through them (read into a slot; the copier copies it out and
    frees the slot). The buffers come back when the request is done."""
    bs = int(disp.engine.block_size)
    leases = [await pool.acquire()]
    try:
        want = -(-n // pool.buffer_bytes)
        while len(leases) < want:
            more = pool.try_acquire()
            if more is None:
                break
            leases.append(more)
        per = pool.buffer_bytes // bs
        slots = [lease.ptr + i * bs for lease in leases for i in range(per)][: -(-n // bs)]
    except BaseException:
        for lease in leases:
            lease.release()
        raise

    def fin(_res: int) -> None:
        for lease in leases:
            lease.release()

    ref.acquire()
    done = _then_release(fin, ref)
    try:
        f = disp.submit(
            op, ref.fd, ptr, n, off, path=ref.path, finalize=done, keep=keep, slots=slots, sums=sums
        )
    except BaseException:
        done(-errno.ECANCELED)  # never reached the engine: give back the ref and the buffers now
        raise
    futs.append(f)


def _releaser(lease: Lease) -> Callable[[int], None]:
    return lambda _res: lease.release()


def _loop_copier(lease: Lease, dst: int, size: int) -> Callable[[int], None]:
    """``SWITCHES.loop_thread_copy``'s read finalizer: the whole chunk, on the loop thread, if read in full."""

    def fin(res: int) -> None:
        try:
            if res == size:
                memcpy(dst, lease.ptr, size)
        finally:
            lease.release()

    return fin


async def fsync(disp: Dispatcher, ref: FileRef) -> None:
    ref.acquire()
    await disp.submit(FSYNC, ref.fd, 0, 0, 0, path=ref.path, finalize=ref.done)


def check_readable(ref: FileRef, nbytes: int, offset: int) -> None:
    """A file too short for the read is an error before any I/O."""
    size = os.fstat(ref.fd).st_size
    if size < offset + nbytes:
        raise ShortIOError(ref.path, size, max(0, size - offset), nbytes)
