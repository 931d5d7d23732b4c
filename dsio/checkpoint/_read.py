"""Reading one safetensors file (dsio's or anyone's) into fresh tensors, verifying checksums.

The tensors to read (all of them, or those a lazy load does not leave in the file) are read as
spans: each run of tensors that lie back to back in the file gets ONE fresh allocation, placed so
that its address has the same offset within a 4096-byte page as its first byte in the file, and the
tensors are views of it (329 tensors staged one by one were slower). A span is read with dsio's raw
read path (fresh page-aligned memory: staged through the handle's pool on huge pages, the copier
threads faulting the destination in behind the disk) as ONE request, the raw read's shape. Its
checksums are computed by the engine's copier as each 1 MiB piece lands (`dsio._sums`): each 64 KiB
step's crc32c, then its copy out, while the step is in the cache, so they cost no pass over memory
of their own and overlap the disk like the copies. For that the span's bytes are cut into fragments
at every tensor's bounds and on the engine's piece grid (`_cuts`); each tensor's crc32c is joined
from its fragments' (`crc_extend`) and checked before `read_file` returns. Whatever the engine left
(the file's unaligned tail page, read buffered on its own; all of it on a CPU without a crc32c
instruction) is checksummed here once its request is read. Measured:
bench/results/checkpoint-2026-12-02-load-s10-under-load.md (``SWITCHES.engine_sums=False``:
checksummed after each read instead, the former way). Where the checksums are this reader's to
compute, a span is read in halves instead (`piece_bounds`).

Lifetime: a loaded tensor keeps its whole span alive (the memory of every tensor of that file is
freed when the last of them is gone); ``clone()`` a tensor to keep it alone.

`read_file_into` fills existing tensors instead (a resume's ``load(into=state)``: no fresh memory
at all; its docstring says how).
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .._gather import wait_all
from .._memory import aligned_buffer, memcpy
from .._sums import ReadSums, engine_sums
from ..errors import CheckpointMismatchError, ChecksumError, TensorLayoutError
from ..file import AsyncFile
from ..handle import AsyncIOHandle
from ._format import MAX_HEADER_BYTES, Header, TensorEntry, parse_header, parse_header_length
from ._integrity import crc_continue, crc_extend, crc_of, parse_blocks, parse_checksums
from ._stored import StoredFile, StoredTensor

__all__ = ["piece_bounds", "placed", "read_file", "read_file_into", "read_header"]

_ALIGN = 4096
_FIRST_READ = 64 << 10
#: The smallest piece a span is cut into (`piece_bounds`; page multiples); None: the whole span
#: in one request where the engine checksums it on the way (or nothing is checksummed), else the
#: handle's staging pool over `IN_FLIGHT` (32 MiB with `DEFAULT_IO`'s 64 MiB pool), at least one
#: pool buffer. Spans up to twice this are read in one request.
PIECE_BYTES: int | None = None
#: Pieces in flight at once (in file order): the next piece's request is made (its destination
#: queued for prefaulting) while one is read; a staged read takes every free pool buffer it can
#: use, so it starts as the one before gives them back.
IN_FLIGHT = 2
#: A piece is checksummed in parts of at most this many bytes, spread over the checksum threads.
CRC_BYTES = 32 << 20
#: Checksum threads per load (the ``crc32c`` package releases the GIL).
CRC_THREADS = 2
#: Fragments the engine left (a file's unaligned tail page, read buffered on its own) of at most
#: this many bytes in all are checksummed on the event loop's thread, not handed to a thread.
INLINE_CRC_BYTES = 256 << 10
#: `read_file_into`: bytes per bounce buffer (one read request each) and how many buffers: while
#: one piece is copied out, the next `IN_FLIGHT` are read. Under load (raw reads of 2.84 GiB
#: through such buffers, bench/results/checkpoint-load-s9-under-load.md): 64 MiB x 3 with 2 reads
#: in flight 1.45-1.49 s (median) vs 3 in flight 1.69-1.80 s, 256 MiB pieces 2.8 s (each load
#: faults its buffers in: big fresh huge pages are slow on this VM).
INTO_PIECE_BYTES = 64 << 20
INTO_BUFFERS = 3
#: `read_file_into` checksums and copies a part in steps of this many bytes, so that the copy
#: reads what the checksum just brought into the cache: 0.53-0.79 CPU s per in-place load of the
#: 2.84 GiB state vs 0.70-1.20 with the whole part checksummed, then copied (4 loads each, under
#: load 4-4.5).
COPY_STEP_BYTES = 1 << 20


async def read_header(f: AsyncFile, path: str, size: int, limit: int = MAX_HEADER_BYTES) -> Header:
    """The validated header of the open file ``f`` of ``size`` bytes; a header over ``limit``
    bytes is refused before it is read."""
    first = torch.empty(min(size, _FIRST_READ), dtype=torch.uint8)
    if first.numel():
        await f.pread(first, 0)
    n = parse_header_length(first.numpy().tobytes()[:8], size, path, limit)
    if 8 + n <= first.numel():
        raw = first[8 : 8 + n].numpy().tobytes()
    else:
        rest = torch.empty(n, dtype=torch.uint8)
        await f.pread(rest, 8)
        raw = rest.numpy().tobytes()
    return parse_header(raw, size, path)


def placed(nbytes: int, file_offset: int) -> torch.Tensor:
    """``nbytes`` of fresh memory whose address is congruent to ``file_offset`` modulo 4096."""
    base = torch.empty(nbytes + _ALIGN, dtype=torch.uint8)
    s = (file_offset - base.data_ptr()) % _ALIGN
    return base[s : s + nbytes]


def _enclosed(begin: int, end: int, file_size: int) -> tuple[torch.Tensor, int, torch.Tensor]:
    """Fresh memory for file bytes ``[begin, end)``, read as the whole pages around them.

    Returns ``(io, io_offset, data)``: ``io`` is page-aligned memory for the page-aligned file
    range ``[io_offset, ...)`` (clipped at the end of the file) and ``data`` the view of
    ``[begin, end)`` inside it, so every piece of ``io`` cut at page multiples is one O_DIRECT
    request with no partial page going through the page cache.
    """
    lo = begin & ~(_ALIGN - 1)
    hi = min(-(-end // _ALIGN) * _ALIGN, file_size)
    base = torch.empty(hi - lo + _ALIGN, dtype=torch.uint8)
    s = (-base.data_ptr()) % _ALIGN
    io = base[s : s + hi - lo]
    return io, lo, io[begin - lo : end - lo]


def _typed(raw: torch.Tensor, e: TensorEntry) -> torch.Tensor:
    if not e.nbytes:
        return torch.empty(e.shape, dtype=e.dtype)
    esize = torch.empty(0, dtype=e.dtype).element_size()
    if raw.data_ptr() % esize:  # a file whose tensors are not aligned to their element size
        raw = raw.clone()
    return raw.view(e.dtype).view(e.shape)


def piece_bounds(nbytes: int, low: int) -> list[tuple[int, int]]:
    """``nbytes`` (of a span's page-aligned memory) cut into requests ``[(a, b), ...]`` in order:
    each half of what is left (rounded down to a page), at least ``low`` (a page multiple), the
    last one the rest once at most ``2 * low`` is left. So a span takes about log2(nbytes / low)
    requests and its last piece, whose checksum nothing overlaps, is small.

    Used where the checksums are this reader's to compute (``SWITCHES.engine_sums`` off, or no crc32c
    instruction): 1454, 727, 364, ... 45 MiB for the 2.84 GiB state of bench/checkpoint.py, `IN_FLIGHT`
    at a time, each piece checksummed in `CRC_BYTES` parts on `CRC_THREADS` threads while the next
    ones are read."""
    out, a = [], 0
    while nbytes - a > 2 * low:
        k = max(low, (nbytes - a) // 2 // _ALIGN * _ALIGN)
        out.append((a, a + k))
        a += k
    if a < nbytes:
        out.append((a, nbytes))
    return out


def spans(entries: tuple[TensorEntry, ...]) -> list[list[TensorEntry]]:
    """The entries (in file order) grouped into runs that lie back to back in the file."""
    out: list[list[TensorEntry]] = []
    for e in sorted(entries, key=lambda e: (e.begin, e.end)):
        if out and out[-1][-1].end == e.begin:
            out[-1].append(e)
        else:
            out.append([e])
    return out


class _Joined:
    """Tensors' crc32c joined from parts checksummed in any order (an in-place load's), each
    checked once whole."""

    def __init__(self, run: list[TensorEntry], sums: dict[str, int], path: str) -> None:
        self.sums, self.path = sums, path
        self.parts: dict[str, list[tuple[int, int, int]]] = {e.name: [] for e in run}
        self.left = {e.name: e.nbytes for e in run}
        for e in run:
            if not e.nbytes:  # nothing to read: its recorded checksum must be the empty one
                self.left.pop(e.name)
                self._check(e.name, 0)

    def _check(self, name: str, got: int) -> None:
        if got != self.sums[name]:
            raise ChecksumError(
                f"tensor {name!r} in {self.path}: crc32c {got:08x} does not match the recorded "
                f"{self.sums[name]:08x} (corrupted file)"
            )

    def finish(self) -> None:
        """Every byte of every tensor was checked (a reader's bug otherwise, never user input)."""
        if self.left:
            raise RuntimeError(f"{self.path}: tensors left unverified: {sorted(self.left)[:5]}")

    def add(self, e: TensorEntry, at: int, crc: int, n: int) -> None:
        self.parts[e.name].append((at, crc, n))
        self.left[e.name] -= n
        if self.left[e.name] == 0:
            del self.left[e.name]
            got = 0
            for _, c, k in sorted(self.parts.pop(e.name)):
                got = crc_extend(got, c, k)
            self._check(e.name, got)


class _Sums:
    """One span's tensors' crc32c from its fragments' (`_Joined` checks each tensor once whole).

    The span's data is cut into fragments (`ReadSums`): at every tensor's bounds and on the grid of
    the engine's pieces of each request, so that each fragment lies in one tensor and one piece. The
    engine checksums the fragments of each piece as it lands (`dsio._sums`); once a request is read,
    `take` records its fragments, with the checksums of those the engine left (`missing`) computed
    by the reader."""

    def __init__(
        self, run: list[TensorEntry], sums: dict[str, int], path: str, ds: int, cuts: list[int]
    ) -> None:
        self.joined = _Joined(run, sums, path)
        self.ds, self.cuts = ds, cuts
        self.fragments = ReadSums(cuts) if len(cuts) > 1 else None
        self.owner: list[TensorEntry] = []  # the tensor of each fragment
        i = 0
        for j in range(len(cuts) - 1):
            while ds + run[i].end <= cuts[j]:  # past this tensor (empty ones included)
                i += 1
            self.owner.append(run[i])

    def within(self, lo: int, hi: int) -> range:
        """The fragments inside file bytes ``[lo, hi)`` (a request's: its bounds within the span's
        data are cuts; it may reach past the data, to whole pages)."""
        start = bisect.bisect_left(self.cuts, lo)
        return range(start, max(start, bisect.bisect_right(self.cuts, hi) - 1))

    def missing(self, frags: range) -> list[int]:
        """Those of ``frags`` the engine did not checksum."""
        if self.fragments is None or not frags:
            return []
        got = self.fragments.values(frags.start, frags.stop)
        return [j for j, v in zip(frags, got, strict=True) if v is None]

    def take(self, frags: range, mine: dict[int, int]) -> None:
        """Record ``frags``' checksums (the engine's, or ``mine`` for those it left): each tensor
        whose bytes are all known is checked (``ChecksumError``)."""
        if self.fragments is None or not frags:
            return
        cuts = self.cuts
        for j, v in zip(frags, self.fragments.values(frags.start, frags.stop), strict=True):
            e = self.owner[j]
            self.joined.add(
                e, cuts[j] - self.ds - e.begin, mine[j] if v is None else v, cuts[j + 1] - cuts[j]
            )

    def finish(self) -> None:
        self.joined.finish()


def _cuts(
    run: list[TensorEntry], ds: int, io_off: int, bounds: list[tuple[int, int]], block: int
) -> list[int]:
    """The fragments' bounds (file offsets) of a span read as requests ``bounds`` (offsets in its
    memory, which holds the file from ``io_off``): every tensor's start and end, and the engine's
    piece grid of each request (every ``block`` bytes from its start, and where its unaligned tail,
    read on its own, begins), within the span's data."""
    lo, hi = ds + run[0].begin, ds + run[-1].end
    cuts = {ds + e.begin for e in run}
    cuts.add(hi)
    for a, b in bounds:
        start, end = io_off + a, io_off + b
        cuts.update(range(start, end, block))
        cuts.update((end, end & ~(_ALIGN - 1)))
    return sorted(c for c in cuts if lo <= c <= hi)


def _crcs(base: int, cuts: list[int], frags: list[int]) -> dict[int, int]:
    """crc32c of fragments ``frags`` (file offset x at address ``base + x``); on a worker thread."""
    return {j: crc_of(base + cuts[j], cuts[j + 1] - cuts[j]) for j in frags}


async def _checksum_missing(
    ex: Callable[[], concurrent.futures.Executor], base: int, checks: _Sums, frags: range
) -> None:
    """Checksum the fragments of ``frags`` the engine left (none, or a tail page, where it
    checksums as it reads), in parts of at most `CRC_BYTES` on the checksum threads, and record
    them all in ``checks``."""
    todo = checks.missing(frags)
    mine: dict[int, int] = {}
    if todo:
        cuts = checks.cuts
        parts: list[list[int]] = [[]]
        size = 0
        for j in todo:
            if size >= CRC_BYTES:
                parts.append([])
                size = 0
            parts[-1].append(j)
            size += cuts[j + 1] - cuts[j]
        if len(parts) == 1 and size <= INLINE_CRC_BYTES:
            mine = _crcs(base, cuts, todo)  # a page or so: not worth a thread hand-off
        else:
            loop = asyncio.get_running_loop()
            pool = ex()
            for part in await wait_all([loop.run_in_executor(pool, _crcs, base, cuts, p) for p in parts]):
                mine.update(part)
    checks.take(frags, mine)


async def read_file(
    handle: AsyncIOHandle,
    path: str,
    *,
    verify: bool = True,
    fd: int | None = None,
    lazy_from: int | None = None,
    stored: StoredFile | None = None,
) -> tuple[Header, dict[str, torch.Tensor | StoredTensor]]:
    """All tensors of ``path`` (in file order) and its header. ``verify`` checks crc32c where recorded.

    The tensors of one run of back-to-back tensors are views of one allocation (see the module's
    note on lifetime).

    ``fd``, when given, is the already opened and checked file (``_fs.open_regular``) that
    ``path`` names: it is reopened through ``/proc/self/fd`` (the same inode, whatever ``path``
    names by now, and with O_DIRECT where the handle uses it); ``path`` is only used in errors.

    ``lazy_from`` (with ``stored``, the open file): tensors of at least that many bytes are not
    read but returned as `StoredTensor`s over ``stored`` (checked as their consumer reads them).
    """
    path = os.fspath(path)
    async with handle.open(path if fd is None else f"/proc/self/fd/{fd}", "r") as f:
        size = f.size
        header = await read_header(f, path, size)
        ds = header.data_start
        sums = parse_checksums(header.metadata, [e.name for e in header.entries], path) if verify else None
        block_bytes, blocks = parse_blocks(
            header.metadata, {e.name: e.nbytes for e in header.entries}, sums, path
        )
        out: dict[str, torch.Tensor | StoredTensor] = {}
        left = tuple(header.entries)
        if lazy_from is not None:
            if stored is None:
                raise ValueError("lazy_from needs the open file (stored)")
            left = tuple(e for e in header.entries if e.nbytes < lazy_from)
            for e in header.entries:
                if e.nbytes >= lazy_from:
                    out[e.name] = StoredTensor(
                        stored,
                        ds + e.begin,
                        e.dtype,
                        e.shape,
                        name=e.name,
                        crc32c=None if sums is None else sums[e.name],
                        io=handle,
                        blocks=blocks.get(e.name),
                        block_bytes=block_bytes,
                    )
        # Every span's memory and its requests, in file order. One request per span (the raw
        # read's shape) unless the checksums are ours to compute after each request: then halves,
        # so that they overlap the next requests.
        cfg = handle.config
        halves = sums is not None and not engine_sums()
        share = max(cfg.staging_buffer_bytes, cfg.pool_bytes // IN_FLIGHT) // _ALIGN * _ALIGN
        block = cfg.block_size  # the engine's piece size
        pieces: list[tuple[torch.Tensor, int, int, int, _Sums | None]] = []
        views: list[tuple[list[TensorEntry], torch.Tensor]] = []
        all_checks: list[_Sums] = []
        for run in spans(left):
            begin, end = run[0].begin, run[-1].end
            io, io_off, raw = _enclosed(ds + begin, ds + end, size)
            views.append((run, raw))
            low = PIECE_BYTES or (share if halves else max(io.numel(), _ALIGN))
            bounds = piece_bounds(io.numel(), low)
            checks = None
            if sums is not None:
                checks = _Sums(run, sums, path, ds, _cuts(run, ds, io_off, bounds, block))
                all_checks.append(checks)
            for a, b in bounds:
                pieces.append((io, io_off, a, b, checks))
        pool: list[concurrent.futures.ThreadPoolExecutor] = []

        def executor() -> concurrent.futures.Executor:
            if not pool:
                pool.append(
                    concurrent.futures.ThreadPoolExecutor(CRC_THREADS, thread_name_prefix="dsio-ckpt-crc")
                )
            return pool[0]

        gate = asyncio.Semaphore(IN_FLIGHT)
        failed: list[BaseException] = []  # once a piece failed, the pieces not yet started are skipped

        async def read_piece(io: torch.Tensor, io_off: int, a: int, b: int, checks: _Sums | None) -> None:
            try:
                async with gate:
                    if failed:
                        return
                    if checks is None or checks.fragments is None:
                        await f.pread(io[a:b], io_off + a)
                    else:
                        await f.pread(io[a:b], io_off + a, sums=checks.fragments)
                if checks is not None:
                    # file offset x sits at io.data_ptr() + (x - io_off)
                    frags = checks.within(io_off + a, io_off + b)
                    await _checksum_missing(executor, io.data_ptr() - io_off, checks, frags)
            except BaseException as err:
                failed.append(err)
                raise

        try:
            await wait_all([read_piece(*p) for p in pieces], drain=True)
        finally:
            if pool:
                pool[0].shutdown(wait=True)
        for checks in all_checks:
            checks.finish()
    for run, raw in views:  # typed once read: a tensor misaligned in the file is copied out
        for e in run:
            out[e.name] = _typed(raw[e.begin - run[0].begin : e.end - run[0].begin], e)
    return header, {e.name: out[e.name] for e in header.entries}


def _parts(run: list[TensorEntry], lo: int, hi: int) -> Iterator[tuple[TensorEntry, int, int]]:
    """``(entry, a, b)``: the data bytes ``[a, b)`` of each tensor of ``run`` (in file order) within
    data bytes ``[lo, hi)``."""
    # the first tensor ending after lo: not a walk over every tensor per piece
    for e in run[bisect.bisect_right(run, lo, key=lambda e: e.end) :]:
        if e.begin >= hi:
            break
        a, b = max(lo, e.begin), min(hi, e.end)
        if a < b:
            yield e, a, b


async def _in_parts(
    ex: concurrent.futures.Executor,
    fn: Callable[[int, int], list[tuple[TensorEntry, int, int, int]]],
    lo: int,
    hi: int,
    checks: _Joined | None,
) -> None:
    """``fn(a, b)`` over data bytes ``[lo, hi)`` in `CRC_BYTES` parts on ``ex``'s threads; each
    part's ``(entry, offset in the tensor, crc32c, bytes)`` joined into ``checks``."""
    loop = asyncio.get_running_loop()
    parts = [loop.run_in_executor(ex, fn, c, min(c + CRC_BYTES, hi)) for c in range(lo, hi, CRC_BYTES)]
    for part in await wait_all(parts):
        if checks is not None:
            for e, at, crc, n in part:
                checks.add(e, at, crc, n)


def check_targets(header: Header, targets: dict[str, object], path: str) -> dict[str, torch.Tensor]:
    """``targets`` (a state's flattened tensors, by name) as the destinations of the file's tensors:
    the same names, and each a contiguous dense CPU tensor of its entry's dtype and shape.

    Checked before any byte is read: a name on one side only, another dtype or another shape is
    ``CheckpointMismatchError`` (naming up to 5 of each); a destination that is no tensor, not
    contiguous, sparse, not on the CPU, a lazy conjugate / negative view, or that shares bytes with
    another, is ``TensorLayoutError``."""
    names = {e.name for e in header.entries}
    missing, extra = sorted(names - targets.keys()), sorted(targets.keys() - names)
    if missing or extra:
        raise CheckpointMismatchError(
            f"{path}: the state to load into does not match the file's tensors "
            f"(in the file only: {missing[:5]}{'...' if len(missing) > 5 else ''}; "
            f"in the state only: {extra[:5]}{'...' if len(extra) > 5 else ''})"
        )
    out: dict[str, torch.Tensor] = {}
    wrong = []
    for e in header.entries:
        t = targets[e.name]
        if (
            not isinstance(t, torch.Tensor)
            or t.is_sparse
            or t.device.type != "cpu"
            or not t.is_contiguous()
            or t.is_conj()  # lazy views: the memory holds the values before the conjugation / negation
            or t.is_neg()
        ):
            what = (
                type(t).__name__
                if not isinstance(t, torch.Tensor)
                else f"{'non-contiguous ' if not t.is_contiguous() else ''}"
                f"{'lazily conjugated ' if t.is_conj() else ''}{'lazily negated ' if t.is_neg() else ''}"
                f"{t.layout} on {t.device}"
            )
            raise TensorLayoutError(
                f"{path}: the destination of {e.name!r} must be a contiguous dense CPU tensor, not {what}"
            )
        if t.dtype != e.dtype or tuple(t.shape) != e.shape:
            wrong.append(f"{e.name!r}: file {e.dtype} {list(e.shape)}, state {t.dtype} {list(t.shape)}")
        out[e.name] = t
    if wrong:
        raise CheckpointMismatchError(f"{path}: tensors differ from the state's: {'; '.join(wrong[:5])}")
    # two destinations sharing bytes would each get the other's values there, unnoticed
    reach, holder = 0, ""
    for start, end, name in sorted(
        (t.data_ptr(), t.data_ptr() + t.nbytes, n) for n, t in out.items() if t.nbytes
    ):
        if start < reach:
            raise TensorLayoutError(f"{path}: the destinations of {holder!r} and {name!r} share memory")
        if end > reach:
            reach, holder = end, name
    return out


def _copy_sums(
    src: int, dst: dict[str, int], lo: int, hi: int, run: list[TensorEntry], verify: bool
) -> list[tuple[TensorEntry, int, int, int]]:
    """Data bytes ``[lo, hi)`` (at address ``src`` + data offset) checksummed (``verify``) and copied
    into each tensor's destination (``dst``: its address); ``(entry, offset in the tensor, crc32c,
    bytes)`` per part, as `_piece_sums`. Runs on a worker thread (neither call holds the GIL)."""
    out = []
    step = COPY_STEP_BYTES
    for e, a, b in _parts(run, lo, hi):
        to = dst[e.name] - e.begin
        if not verify:
            memcpy(to + a, src + a, b - a)
            crc = 0
        else:  # checksummed step by step just before each step is copied: one read from memory
            crc = 0
            for c in range(a, b, step):
                k = min(step, b - c)
                crc = crc_continue(src + c, k, crc)
                memcpy(to + c, src + c, k)
        out.append((e, a - e.begin, crc, b - a))
    return out


async def read_file_into(
    handle: AsyncIOHandle,
    path: str,
    targets: dict[str, object],
    *,
    verify: bool = True,
    fd: int | None = None,
) -> tuple[Header, dict[str, torch.Tensor]]:
    """Read every tensor of ``path`` into ``targets[name]`` (see `check_targets`), in place; return
    the header and the targets by name (file order). ``verify`` checks crc32c where recorded.

    Every tensor's checksum is checked before this returns; on any error (``ChecksumError``
    included) the targets hold unspecified contents (some of their bytes may be the file's,
    verified or not) and nothing is still reading into or copying into them. ``fd``: as
    `read_file`'s.

    The data section goes through `INTO_BUFFERS` reused bounce buffers of `INTO_PIECE_BYTES` (huge
    pages where the kernel gives them, faulted in once per load), each read straight from the disk
    (O_DIRECT into resident memory, `IN_FLIGHT` at a time), then on the checksum threads each
    tensor's part is checksummed in the bounce buffer and copied into its tensor while the next
    pieces are read. The destinations are the caller's tensors, at whatever address within a page
    their allocator chose, so they cannot take the file's pages directly; the copy (~12 GB/s a core)
    costs less CPU than faulting fresh memory in (~4.7 GB/s a core here)."""
    path = os.fspath(path)
    async with handle.open(path if fd is None else f"/proc/self/fd/{fd}", "r") as f:
        size = f.size
        header = await read_header(f, path, size)
        dst = check_targets(header, targets, path)
        ds = header.data_start
        sums = parse_checksums(header.metadata, [e.name for e in header.entries], path) if verify else None
        run = sorted((e for e in header.entries if e.nbytes), key=lambda e: e.begin)
        checks = _Joined(list(header.entries), sums, path) if sums is not None else None
        addr = {e.name: dst[e.name].data_ptr() for e in run}
        lo = ds & ~(_ALIGN - 1)  # the data section's bytes, read from the page holding its first byte
        piece = min(INTO_PIECE_BYTES, -(-(size - lo) // _ALIGN) * _ALIGN)  # a small file: one small buffer
        starts = list(range(lo, size, piece)) if run else []
        bufs = []
        for _ in range(min(INTO_BUFFERS, len(starts))):
            mem = aligned_buffer(piece, lock=False, hugepage=True)
            torch.frombuffer(mem, dtype=torch.uint8).zero_()  # resident: each read goes straight in
            bufs.append(mem)
        free: asyncio.Queue[Any] = asyncio.Queue()
        for mem in bufs:
            free.put_nowait(mem)
        ex = concurrent.futures.ThreadPoolExecutor(CRC_THREADS, thread_name_prefix="dsio-ckpt-into")
        gate = asyncio.Semaphore(IN_FLIGHT)
        failed: list[BaseException] = []

        async def one(start: int) -> None:
            mem = await free.get()
            try:
                if failed:
                    return
                end = min(start + piece, size)
                async with gate:
                    await f.pread(torch.frombuffer(mem, dtype=torch.uint8)[: end - start], start)
                base = mem.ptr - (start - ds)  # data byte d sits at base + d
                summed = checks is not None  # the file records checksums and verify is on
                await _in_parts(
                    ex,
                    lambda c, d: _copy_sums(base, addr, c, d, run, summed),
                    max(start, ds) - ds,
                    end - ds,
                    checks,
                )
            except BaseException as err:
                failed.append(err)
                raise
            finally:
                free.put_nowait(mem)

        try:
            await wait_all([one(s) for s in starts], drain=True)
        finally:
            ex.shutdown(wait=True)  # no copy is still running into a target or out of a buffer
        if checks is not None:
            checks.finish()
    return header, {e.name: dst[e.name] for e in header.entries}
