"""Where a checkpointed function's inputs wait for its backward: on their device, in host memory, or on NVMe.

A store's `save` takes the inputs during forward and returns a `Saved` ticket; `load` gives back
tensors equal bit for bit (same dtype, shape, device, ``requires_grad``) at backward. A ticket that is
dropped unloaded (a graph freed without backward) gives its memory back. Every store counts the bytes
it holds (`Held`).
"""

from __future__ import annotations

import concurrent.futures
import os
import weakref
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from dstrain.errors import ConfigError

if TYPE_CHECKING:
    from dsio.config import IOConfig
    from dstrain.offload.swap import Lease, Swapper

__all__ = ["DeviceStore", "Held", "HostStore", "NvmeStore", "Saved", "Store"]

_ALIGN = 64
"""Byte alignment of each tensor inside an NVMe buffer (any dtype's view stays aligned)."""


@dataclass(slots=True)
class Held:
    """Live and peak bytes one store holds, by where they are."""

    live: int = 0
    peak: int = 0

    def add(self, n: int) -> None:
        self.live += n
        self.peak = max(self.peak, self.live)

    def sub(self, n: int) -> None:
        self.live -= n


@dataclass(frozen=True, slots=True)
class _Meta:
    dtype: torch.dtype
    shape: torch.Size
    device: torch.device
    requires_grad: bool
    offset: int = 0


@dataclass(eq=False)
class Saved:
    """One checkpoint's saved inputs: ``args`` with each tensor replaced by its index into ``metas``."""

    args: tuple[Any, ...]
    metas: list[_Meta]
    nbytes: int
    payload: Any = None
    """What the store keeps (tensors, host copies, or the NVMe slot key)."""
    fetch: concurrent.futures.Future[Lease] | None = None
    store: Store | None = field(default=None, repr=False)

    def __del__(self) -> None:
        if self.store is not None:
            self.store.drop(self)


class _Slot:
    """Marks a tensor argument's position in `Saved.args`."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


def _split(args: tuple[Any, ...]) -> tuple[tuple[Any, ...], list[torch.Tensor]]:
    """(args with each tensor but parameters replaced by a `_Slot`, those tensors). Parameters stay as
    references: they are weights, not activations (and ZeRO owns where they live)."""
    out: list[Any] = []
    tensors: list[torch.Tensor] = []
    for a in args:
        if isinstance(a, torch.Tensor) and not isinstance(a, torch.nn.Parameter):
            out.append(_Slot(len(tensors)))
            tensors.append(a)
        else:
            out.append(a)
    return tuple(out), tensors


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _rebuild(saved: Saved, tensors: list[torch.Tensor]) -> list[Any]:
    """The original argument list, each tensor detached and marked ``requires_grad`` as it was."""
    restored = []
    for t, m in zip(tensors, saved.metas, strict=True):
        x = t.detach()
        x.requires_grad_(m.requires_grad)
        restored.append(x)
    return [restored[a.index] if isinstance(a, _Slot) else a for a in saved.args]


class Store:
    """Keeps checkpointed inputs until backward; subclasses decide where."""

    placement = "device"

    def __init__(self) -> None:
        self.held = Held()

    def save(self, args: tuple[Any, ...]) -> Saved:
        plain, tensors = _split(args)
        metas = [_Meta(t.dtype, t.shape, t.device, t.requires_grad) for t in tensors]
        saved = Saved(plain, metas, sum(_nbytes(t) for t in tensors))
        self._put(saved, tensors)
        saved.store = self
        self.held.add(saved.nbytes)
        return saved

    def load(self, saved: Saved) -> list[Any]:
        tensors = self._get(saved)
        saved.store = None
        self.held.sub(saved.nbytes)
        saved.payload = None
        return _rebuild(saved, tensors)

    def drop(self, saved: Saved) -> None:
        """``saved`` was freed without `load`."""
        self.held.sub(saved.nbytes)

    def _put(self, saved: Saved, tensors: list[torch.Tensor]) -> None:
        raise NotImplementedError

    def _get(self, saved: Saved) -> list[torch.Tensor]:
        raise NotImplementedError

    def drain(self) -> None:
        """Wait for the transfers in flight (NVMe writes behind forward)."""

    def close(self) -> None:
        """Release what the store owns (files, pinned buffers)."""

    def io_statistics(self) -> Any:
        return None


class DeviceStore(Store):
    """DeepSpeed's default: the inputs stay where they are (references, no copy)."""

    placement = "device"

    def _put(self, saved: Saved, tensors: list[torch.Tensor]) -> None:
        saved.payload = [t.detach() for t in tensors]

    def _get(self, saved: Saved) -> list[torch.Tensor]:
        return list(saved.payload)


class HostStore(Store):
    """``cpu_checkpointing``: a host copy of each input (pinned when CUDA is available, copied
    asynchronously), copied back to the input's device at backward."""

    placement = "host"

    def __init__(self) -> None:
        super().__init__()
        self._pin = torch.cuda.is_available()

    def _put(self, saved: Saved, tensors: list[torch.Tensor]) -> None:
        copies = []
        for t in tensors:
            host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self._pin)
            host.copy_(t.detach(), non_blocking=self._pin and t.is_cuda)
            copies.append(host)
        saved.payload = copies

    def _get(self, saved: Saved) -> list[torch.Tensor]:
        out = []
        for host, m in zip(saved.payload, saved.metas, strict=True):
            out.append(host.to(m.device, non_blocking=self._pin) if m.device.type != "cpu" else host)
        return out


class NvmeStore(Store):
    """dstrain's NVMe path: each checkpoint's inputs are copied into one pinned buffer and written to
    a slot of a swap file (`dstrain.offload.swap.Swapper`, one dsio handle) during forward; backward reads
    them back in reverse order, up to ``window - 1`` checkpoints ahead of the one it recomputes. At
    most ``window`` buffers exist, so host memory is bounded by ``window x buffer_bytes`` whatever the
    depth; a forward that outruns the disk waits for a buffer (backpressure)."""

    placement = "nvme"

    def __init__(
        self, directory: str, *, window: int, buffer_bytes: int | None, io_config: IOConfig | None
    ) -> None:
        super().__init__()
        if not os.path.isdir(directory):
            raise ConfigError("activation_checkpointing.nvme_path", f"{directory!r} is not a directory")
        self.directory = directory
        self.window = window
        self.buffer_bytes = buffer_bytes
        self._io_config = io_config
        self._swapper: Swapper | None = None  # built at the first save (its buffer size may come from it)
        self._closed_stats: Any = None  # the swapper's last statistics, kept after close
        self._free: list[Hashable] = []
        self._slots = 0
        self._pending: list[weakref.ref[Saved]] = []  # saved and not yet loaded, in forward order
        self._ahead = 0  # fetched ahead and not yet loaded

    def _open(self, nbytes: int) -> Swapper:
        from dstrain.offload.swap.swapper import Swapper, align_up

        if self._swapper is None:
            size = align_up(self.buffer_bytes or nbytes)
            self._swapper = Swapper(
                self.directory,
                "activation",
                buffer_bytes=size,
                buffer_count=self.window,
                io_config=self._io_config,
            )
        return self._swapper

    def _put(self, saved: Saved, tensors: list[torch.Tensor]) -> None:
        layout, end = [], 0
        for t in tensors:
            layout.append(end)
            end += -(-_nbytes(t) // _ALIGN) * _ALIGN
        swapper = self._open(end)
        if end > swapper.buffer_bytes:
            raise ConfigError(
                "activation_checkpointing.nvme_buffer_bytes",
                f"a checkpoint's inputs take {end} bytes, more than one {swapper.buffer_bytes}-byte buffer",
            )
        saved.metas = [
            _Meta(m.dtype, m.shape, m.device, m.requires_grad, off)
            for m, off in zip(saved.metas, layout, strict=True)
        ]
        if self._free:
            key = self._free.pop()
        else:
            key = ("activation", self._slots)
            self._slots += 1
            swapper.reserve(key, swapper.buffer_bytes)
        lease = swapper.acquire(key).result()  # waits while every buffer is being written
        for t, m in zip(tensors, saved.metas, strict=True):
            lease.view(t.dtype, m.offset, t.numel()).view(t.shape).copy_(t.detach())
        swapper.store(lease)  # written behind forward; the buffer returns to the pool after
        saved.payload = key
        self._pending.append(weakref.ref(saved))

    def _get(self, saved: Saved) -> list[torch.Tensor]:
        assert self._swapper is not None
        swapper = self._swapper
        if saved.fetch is None:
            saved.fetch = swapper.fetch(saved.payload)
        else:
            self._ahead -= 1
        live = [s for s in (r() for r in self._pending) if s is not None]
        i = live.index(saved)
        del live[i]
        self._pending = [weakref.ref(s) for s in live]
        # read ahead: the checkpoints saved before this one are recomputed next
        for earlier in reversed(live[:i]):
            if self._ahead >= self.window - 1:
                break
            if earlier.fetch is None:
                earlier.fetch = swapper.fetch(earlier.payload)
                self._ahead += 1
        lease = saved.fetch.result()
        saved.fetch = None
        out = []
        for m in saved.metas:
            numel = 1
            for d in m.shape:
                numel *= d
            view = lease.view(m.dtype, m.offset, numel).view(m.shape)
            out.append(view.to(m.device, copy=True))
        swapper.discard(lease)
        self._free.append(saved.payload)
        return out

    def drop(self, saved: Saved) -> None:
        super().drop(saved)
        self._pending = [r for r in self._pending if r() is not None]
        swapper, key, fetch = self._swapper, saved.payload, saved.fetch
        if swapper is None or key is None:
            return
        if fetch is None:
            self._free.append(key)
            return
        self._ahead -= 1
        free = self._free

        def give_back(f: concurrent.futures.Future[Lease]) -> None:  # the slot is reused after its read
            if f.exception() is None:
                swapper.discard(f.result())
            free.append(key)

        fetch.add_done_callback(give_back)

    def io_statistics(self) -> Any:
        return self._closed_stats if self._swapper is None else self._swapper.statistics()

    def drain(self) -> None:
        if self._swapper is not None:
            self._swapper.drain()

    def close(self) -> None:
        if self._swapper is not None:
            self._swapper.close()
            self._closed_stats = self._swapper.statistics()
            self._swapper = None
            self._free.clear()  # the next swapper's file has no slots yet
            self._slots = 0
            self._pending, self._ahead = [], 0
