"""Lazy checkpoint sources for state that lives in swap files (``dsio.checkpoint.LazyTensor``).

An offloading part's ``checkpoint_state()`` returns `SwapRegions` where its ``state_dict()`` would
return tensors: the checkpoint writer reads each one window at a time from the swap file, after the
swap writes it names have finished, so the state is never materialized. `materialize` turns them
into tensors for a writer that cannot stream (``torch.save``).

A `SwapRegions` built over a *pin* (``dstrain.offload.swap.slots.SwapPin``: slot versions that
training's later writes go around) is ``stable``: training may change the state while the save
still reads it, so an async save neither orders its windows for nor waits on it
(``dsio.checkpoint._capture``). The saver calls `release_sources` once it no longer reads the state
(staging over: success, failure or cancel), which lets the pinned versions go; a pinned source
read after that raises ``dsio.errors.ClosedError``.

Loading goes the other way: a streamed load leaves big tensors in the checkpoint file
(``dsio.checkpoint.StoredTensor``); a part that can take them (``load_checkpoint_state``) copies each
piece straight where it belongs with `read_lazy` (an offloaded optimizer: into its swap buffers), and
`verify_lazy` then checks that every byte it used matched the file's checksums.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from dsio.checkpoint import FileRegions, LazyTensor

if TYPE_CHECKING:
    from dsio.handle import AsyncIOHandle

__all__ = [
    "Pin",
    "Snapshot",
    "SwapRegions",
    "check_lazy",
    "has_lazy",
    "lazy_bytes",
    "materialize",
    "read_lazy",
    "release_sources",
    "verify_lazy",
]


class Pin(Protocol):
    """What a `SwapRegions` holds its bytes with (``dstrain.offload.swap.slots.SwapPin``)."""

    @property
    def released(self) -> bool: ...

    def release(self) -> None: ...


class SwapRegions(FileRegions):
    """`FileRegions` of a swap file whose last writes (``after``: the swapper's futures) must be done
    before its bytes are read (the writer waits for them on dsio's loop, never the training thread).

    With ``pin`` (the regions are versions it holds), the source is ``stable``: its bytes do not
    change while the pin is held, whatever training writes meanwhile. Several sources may share one
    pin; `release` (or `release_sources`) lets it go."""

    def __init__(
        self,
        regions: Iterable[tuple[str | os.PathLike[str], int, int]],
        dtype: torch.dtype,
        shape: Sequence[int],
        *,
        after: Sequence[concurrent.futures.Future[Any]] = (),
        pin: Pin | None = None,
    ) -> None:
        super().__init__(regions, dtype, shape)
        self.after = list(after)
        self.pin = pin
        self.stable = pin is not None
        """Its bytes cannot change while a save reads them (``dsio.checkpoint._capture``)."""
        self._ready: asyncio.Future[Any] | None = None  # every reader waits for the same writes

    def release(self) -> None:
        """The save no longer reads this source: let its pin go (idempotent)."""
        if self.pin is not None:
            self.pin.release()

    async def read_into(self, io: AsyncIOHandle, offset: int, out: torch.Tensor) -> None:
        if self.pin is not None and self.pin.released:
            from dsio.errors import ClosedError

            raise ClosedError("this swap-file source's pinned version was released (its save is over)")
        if self.after:
            if self._ready is None:  # windows are read concurrently: all of them wait on this one
                self._ready = asyncio.ensure_future(
                    asyncio.gather(*(asyncio.wrap_future(f) for f in self.after))
                )
            await asyncio.shield(self._ready)  # a failed swap write fails the save
        await super().read_into(io, offset, out)


class Snapshot(LazyTensor):
    """A private copy of a small tensor taken when the state is described (e.g. Adam's step count):
    nothing else holds it, so it is ``stable`` -- written beside pinned swap versions, it does not
    make their window one the owner's step has to wait for."""

    stable = True

    def __init__(self, tensor: torch.Tensor) -> None:
        copy = tensor.detach().to("cpu", copy=True).contiguous()
        super().__init__(copy.dtype, tuple(copy.shape))
        self._bytes = copy.reshape(-1).view(torch.uint8)

    async def read_into(self, io: AsyncIOHandle, offset: int, out: torch.Tensor) -> None:
        if offset < 0 or offset + out.numel() > self.nbytes:
            raise ValueError(
                f"bytes [{offset}, {offset + out.numel()}) are outside a {self.nbytes}-byte tensor"
            )
        out.copy_(self._bytes[offset : offset + out.numel()])


def _walk(value: Any) -> Iterator[LazyTensor]:
    if isinstance(value, LazyTensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _walk(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _walk(v)


def release_sources(value: Any) -> None:
    """Release every `SwapRegions` of a nested state (a save no longer reads it). Idempotent."""
    for src in _walk(value):
        if isinstance(src, SwapRegions):
            src.release()


def has_lazy(value: Any) -> bool:
    """Whether a nested state holds a `LazyTensor`."""
    if isinstance(value, LazyTensor):
        return True
    if isinstance(value, dict):
        return any(has_lazy(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(has_lazy(v) for v in value)
    return False


def materialize(value: Any) -> Any:
    """A copy of a nested state with every `LazyTensor` read into a tensor (on dsio's loop)."""
    if not has_lazy(value):
        return value
    from dsio import run_sync
    from dsio.checkpoint import DEFAULT_IO
    from dsio.handle import AsyncIOHandle

    async def read_all() -> Any:
        async with AsyncIOHandle(DEFAULT_IO) as io:

            async def walk(v: Any) -> Any:
                if isinstance(v, LazyTensor):
                    return await v.materialize(io)
                if isinstance(v, dict):
                    return type(v)([(k, await walk(x)) for k, x in v.items()])
                if isinstance(v, list | tuple):
                    return type(v)([await walk(x) for x in v])
                return v

            return await walk(value)

    return run_sync(read_all())


def lazy_bytes(value: Any) -> int:
    """Bytes of every `LazyTensor` of a nested state (what `materialize` would allocate)."""
    return sum(src.nbytes for src in _walk(value))


#: Window of `check_lazy`'s reads (the one buffer it holds).
CHECK_WINDOW = 8 << 20


def check_lazy(value: Any) -> None:
    """Read every `LazyTensor` of a nested state through one `CHECK_WINDOW` buffer, keeping nothing:
    each stored tensor's bytes are checked against the file's checksums on the way (a mismatch is
    ``dsio.checkpoint.ChecksumError``), so a caller can refuse a corrupted entry before it applies any
    entry, without holding them all in memory."""
    sources = list(_walk(value))
    if not sources:
        return
    from dsio import run_sync
    from dsio.checkpoint import DEFAULT_IO
    from dsio.handle import AsyncIOHandle

    async def read_all() -> None:
        async with AsyncIOHandle(DEFAULT_IO) as io:
            buf = torch.empty(min(CHECK_WINDOW, max(s.nbytes for s in sources)), dtype=torch.uint8)
            for src in sources:
                for at in range(0, src.nbytes, buf.numel()):
                    await src.read_into(io, at, buf[: min(buf.numel(), src.nbytes - at)])

    run_sync(read_all())


def read_lazy(src: LazyTensor, offset: int, out: torch.Tensor) -> None:
    """Fill ``out`` (a contiguous CPU tensor) with bytes ``[offset, offset + out's bytes)`` of ``src``
    (blocking; the read runs on dsio's loop, with the source's own handle where it has one)."""
    from dsio import run_sync

    raw = out.view(torch.uint8).reshape(-1)
    if raw.numel() == 0:
        return
    from dsio.checkpoint import StoredTensor

    io = src.io if isinstance(src, StoredTensor) else None  # a checkpoint file's tensor: its own handle

    async def read() -> None:
        if io is not None:
            await src.read_into(io, offset, raw)
            return
        from dsio.checkpoint import DEFAULT_IO
        from dsio.handle import AsyncIOHandle

        async with AsyncIOHandle(DEFAULT_IO) as h:
            await src.read_into(h, offset, raw)

    run_sync(read())


def verify_lazy(value: Any) -> None:
    """Check the checksum of every stored tensor in a nested state (reading what its consumer did
    not read in order); raises ``dsio.checkpoint.ChecksumError`` on a mismatch."""
    from dsio import run_sync
    from dsio.checkpoint import StoredTensor

    stored = [v for v in _walk(value) if isinstance(v, StoredTensor)]
    for t in stored:
        if not t.verified:
            run_sync(t.verify())
