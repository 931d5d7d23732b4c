"""`checkpoint(fn, *args)`: run ``fn`` without keeping its inside for backward, recompute it there.

The non-reentrant scheme (torch.utils.checkpoint's ``use_reentrant=False``), with the inputs kept by
the configured `Store`: forward runs ``fn`` with gradients, so autograd builds its graph as usual, but
every tensor the graph would save for backward is replaced by a `_Holder` (a saved-tensors hook) and
dropped. The first time backward needs one of them, the inputs come back from the store, the RNG and
autocast state forward saw are replayed (dropout draws the same mask) and ``fn`` runs again, keeping
what each holder stands for; it stops as soon as the last of them is recomputed (the last layer's
output is not recomputed when nothing saved depends on it). Backward then runs through the graph
built in forward. The recompute does the same arithmetic as a forward without checkpointing, so
losses and gradients are equal bit for bit.

Against DeepSpeed's (Megatron's) reentrant scheme (a ``torch.autograd.Function`` that reruns ``fn``
and calls backward inside its backward), this is what ``torch.utils.checkpoint`` does by default: the
early stop saves the last layer's forward, there is no nested backward, and a checkpointed function
may take inputs that do not require gradients.

One `ActivationCheckpointer` is active per process (DeepSpeed's module-level API): `configure` sets it
(`dstrain.initialize` does, from the config's ``activation_checkpointing`` section), `reset` closes it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from dstrain.checkpointing import rng
from dstrain.checkpointing.config import ActivationCheckpointingConfig
from dstrain.checkpointing.stores import DeviceStore, HostStore, NvmeStore, Saved, Store
from dstrain.errors import ConfigError, NotImplementedConfigError, RecomputeError

__all__ = [
    "ActivationCheckpointer",
    "ActivationStatistics",
    "checkpoint",
    "configure",
    "is_configured",
    "reset",
    "statistics",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class ActivationStatistics:
    """What the active checkpointer did and holds (one process)."""

    placement: str
    """``"device"``, ``"host"`` or ``"nvme"``: where checkpointed inputs wait for backward."""
    checkpoints: int
    """Checkpointed forwards run (with gradients enabled)."""
    recomputes: int
    saved_bytes: int
    """Input bytes held now: on the device (``"device"``), in host copies (``"host"``), or written and
    not yet read back (``"nvme"``)."""
    peak_saved_bytes: int
    host_buffer_bytes: int
    """NVMe path: pinned host memory of its buffers (the bound on host memory it uses); 0 otherwise."""
    peak_host_buffers: int
    """NVMe path: most buffers in use at once (<= ``nvme_window``)."""
    nvme_written_bytes: int
    nvme_read_bytes: int
    forward_seconds: float
    """With ``profile``: time in checkpointed forwards; 0 otherwise."""
    recompute_seconds: float
    """With ``profile``: time in recomputes, each up to the last tensor backward needs (backward through
    the recomputed tensors is backward's own time, not included); 0 otherwise."""


class ActivationCheckpointer:
    """The configured behaviour of `checkpoint`: a store for the inputs, synchronisation, profiling."""

    def __init__(self, config: ActivationCheckpointingConfig, io_config: Any = None) -> None:
        self.config = config
        if config.placement == "nvme":
            assert config.nvme_path is not None
            self.store: Store = NvmeStore(
                config.nvme_path,
                window=config.nvme_window,
                buffer_bytes=config.nvme_buffer_bytes,
                io_config=io_config,
            )
        elif config.placement == "host":
            self.store = HostStore()
        else:
            self.store = DeviceStore()
        self._sync = (config.synchronize_checkpoint_boundary or config.profile) and torch.cuda.is_available()
        self.checkpoints = 0
        self.recomputes = 0
        self.forward_seconds = 0.0
        self.recompute_seconds = 0.0

    def boundary(self) -> None:
        """``synchronize_checkpoint_boundary``: wait for the GPU at a checkpoint's edge."""
        if self._sync:
            torch.cuda.synchronize()

    def checkpoint(self, function: Callable[..., Any], *args: Any) -> Any:
        """``function(*args)``, its inside recomputed in backward (see the module docstring)."""
        if not torch.is_grad_enabled() or _inside.active:
            # nothing will run backward: nothing to keep; or nested in a checkpoint, whose hooks
            # already drop (and whose recompute recomputes) what this call would save
            return function(*args)
        frame = _Frame(self, function, rng.capture(), _autocast_state())
        self.boundary()
        start = time.perf_counter()
        with _hooks(frame.pack, _unpack):
            outputs = function(*args)
        self.boundary()
        if self.config.profile:
            self.forward_seconds += time.perf_counter() - start
        self.checkpoints += 1
        if frame.holders:  # else nothing to recompute: the inputs need not wait for backward
            frame.saved = self.store.save(args)
        return outputs

    def drain(self) -> None:
        """Wait for the NVMe writes still in flight (a no-op for the other placements)."""
        self.store.drain()

    def statistics(self) -> ActivationStatistics:
        io = self.store.io_statistics()
        return ActivationStatistics(
            placement=self.store.placement,
            checkpoints=self.checkpoints,
            recomputes=self.recomputes,
            saved_bytes=self.store.held.live,
            peak_saved_bytes=self.store.held.peak,
            host_buffer_bytes=0 if io is None else io.buffers * io.buffer_bytes,
            peak_host_buffers=0 if io is None else io.peak_buffers_in_use,
            nvme_written_bytes=0 if io is None else io.written_bytes,
            nvme_read_bytes=0 if io is None else io.read_bytes,
            forward_seconds=self.forward_seconds,
            recompute_seconds=self.recompute_seconds,
        )

    def after_step(self, engine: Any) -> None:
        """Nothing per step: `initialize` adds the checkpointer to the engine's observers so that
        `Engine.close` closes it (its NVMe swap file and pinned buffers)."""

    def close(self) -> None:
        """Close the store (the NVMe swap file and buffers; a later checkpoint opens them again)."""
        if self.config.profile:
            log.info(
                "activation checkpointing: %d forwards %.3fs, %d recomputes %.3fs",
                self.checkpoints,
                self.forward_seconds,
                self.recomputes,
                self.recompute_seconds,
            )
        self.store.close()


class _Inside(threading.local):
    active = False
    """A checkpoint's forward or recompute is running on this thread (its hooks are installed)."""


_inside = _Inside()


@contextlib.contextmanager
def _hooks(pack: Callable[[torch.Tensor], Any], unpack: Callable[[Any], torch.Tensor]) -> Iterator[None]:
    outer, _inside.active = _inside.active, True
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
    finally:
        _inside.active = outer


class _StopRecompute(Exception):
    """Raised by the recompute's pack hook once every tensor forward saved is recomputed."""


class _Holder:
    """What autograd keeps in place of one tensor a checkpointed forward saved."""

    __slots__ = ("__weakref__", "frame", "index")

    def __init__(self, frame: _Frame, index: int) -> None:
        self.frame = frame
        self.index = index


_AUTOCAST_DEVICES = ("cpu", "cuda")


def _autocast_state() -> tuple[tuple[tuple[str, bool, torch.dtype], ...], bool]:
    """Autocast as forward runs under it (the recompute, in backward, runs under the same)."""
    devices = tuple(
        (d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
        for d in _AUTOCAST_DEVICES
        if d == "cpu" or torch.cuda.is_available()
    )
    return devices, torch.is_autocast_cache_enabled()


class _Frame:
    """One checkpointed call, from its forward to its recompute. The holders autograd keeps are its
    only owners: a graph freed without backward frees the frame, and with it the saved inputs."""

    def __init__(
        self,
        ckpt: ActivationCheckpointer,
        run: Callable[..., Any],
        rng_state: rng.RNGState,
        autocast: tuple[tuple[tuple[str, bool, torch.dtype], ...], bool],
    ) -> None:
        self.ckpt = ckpt
        self.run = run
        self.rng = rng_state
        self.autocast = autocast
        self.saved: Saved | None = None
        self.holders: list[weakref.ref[_Holder]] = []
        self.metas: list[tuple[torch.Size, torch.dtype]] = []
        # holder -> its recomputed tensor, freed with the holder (after the node that saved it ran)
        self.recomputed: weakref.WeakKeyDictionary[_Holder, torch.Tensor] = weakref.WeakKeyDictionary()

    def pack(self, t: torch.Tensor) -> _Holder:
        holder = _Holder(self, len(self.holders))
        self.holders.append(weakref.ref(holder))
        self.metas.append((t.shape, t.dtype))
        return holder

    def recompute(self) -> None:
        ckpt, saved = self.ckpt, self.saved
        if saved is None:
            raise RecomputeError(
                "a checkpointed function's inputs were already used by its recompute (a second "
                "backward through a graph that was not kept with retain_graph=True?)"
            )
        inputs = ckpt.store.load(saved)
        self.saved = None
        count = len(self.holders)
        index = 0

        def pack(t: torch.Tensor) -> None:
            nonlocal index
            if index < count:
                holder = self.holders[index]()
                if holder is not None:  # else its node already ran backward: nothing needs it
                    if (t.shape, t.dtype) != self.metas[index]:
                        raise RecomputeError(
                            f"the recompute saved a {t.dtype} {tuple(t.shape)} tensor where forward "
                            f"saved a {self.metas[index][1]} {tuple(self.metas[index][0])} one (tensor "
                            f"{index} of {count}): the checkpointed function must do the same work twice"
                        )
                    self.recomputed[holder] = t.detach()
            index += 1
            if index >= count:
                raise _StopRecompute

        ckpt.boundary()
        start = time.perf_counter()
        devices, cache = self.autocast
        with contextlib.ExitStack() as stack:
            for device, enabled, dtype in devices:
                stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled, cache_enabled=cache))
            stack.enter_context(rng.replay(self.rng))
            stack.enter_context(torch.enable_grad())
            stack.enter_context(_hooks(pack, _refuse_unpack))
            stack.enter_context(contextlib.suppress(_StopRecompute))
            self.run(*inputs)
        ckpt.boundary()
        if ckpt.config.profile:
            ckpt.recompute_seconds += time.perf_counter() - start
        ckpt.recomputes += 1
        if index < count:
            raise RecomputeError(
                f"the recompute saved {index} tensors where forward saved {count}: the checkpointed "
                "function must do the same work twice"
            )


def _unpack(holder: _Holder) -> torch.Tensor:
    frame = holder.frame
    if holder not in frame.recomputed:
        frame.recompute()
    return frame.recomputed[holder]


def _refuse_unpack(packed: Any) -> torch.Tensor:
    raise RecomputeError("backward through a checkpoint's recompute (the recompute's graph is never kept)")


_ACTIVE: ActivationCheckpointer | None = None
_CONFIGURED = False


def configure(
    mpu_: Any = None,
    deepspeed_config: Any = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
    *,
    io_config: Any = None,
) -> ActivationCheckpointer:
    """DeepSpeed's ``deepspeed.checkpointing.configure``: settings from ``deepspeed_config`` (a config
    dict, JSON path, `DSConfig` or `ActivationCheckpointingConfig`), each overridden by the keyword
    given. ``mpu_`` (a tensor-parallel unit) is refused with more than one model-parallel rank. Closes
    the checkpointer configured before; returns the new one."""
    global _ACTIVE, _CONFIGURED
    if mpu_ is not None and mpu_.get_model_parallel_world_size() > 1:
        raise NotImplementedConfigError("mpu_", "dstrain has no tensor parallelism")
    for key, value in (
        ("partition_activations", partition_activations),
        ("contiguous_memory_optimization", contiguous_checkpointing),
    ):
        if value:  # the section's own check refuses the same keys (dstrain has no tensor parallelism)
            ActivationCheckpointingConfig.from_dict({key: value})
    base = _section(deepspeed_config)
    overrides: dict[str, Any] = {
        "number_checkpoints": num_checkpoints,
        "cpu_checkpointing": checkpoint_in_cpu,
        "synchronize_checkpoint_boundary": synchronize,
        "profile": profile,
    }
    config = dataclasses.replace(base, **{k: v for k, v in overrides.items() if v is not None})
    reset()
    _ACTIVE = ActivationCheckpointer(config, io_config)
    _CONFIGURED = True
    return _ACTIVE


def _section(deepspeed_config: Any) -> ActivationCheckpointingConfig:
    from dstrain.config import DSConfig

    if deepspeed_config is None:
        return ActivationCheckpointingConfig()
    if isinstance(deepspeed_config, ActivationCheckpointingConfig):
        return deepspeed_config
    if isinstance(deepspeed_config, DSConfig):
        return deepspeed_config.activation_checkpointing or ActivationCheckpointingConfig()
    if isinstance(deepspeed_config, dict):
        return ActivationCheckpointingConfig.from_dict(deepspeed_config.get("activation_checkpointing"))
    try:
        import json

        with open(deepspeed_config) as f:
            data = json.load(f)
    except (OSError, TypeError, ValueError) as e:
        raise ConfigError("deepspeed_config", f"expected a config dict, path or DSConfig: {e}") from e
    return ActivationCheckpointingConfig.from_dict(data.get("activation_checkpointing"))


def is_configured() -> bool:
    """True once `configure` ran (DeepSpeed's ``is_configured``)."""
    return _CONFIGURED


def _active() -> ActivationCheckpointer:
    global _ACTIVE
    if _ACTIVE is None:  # DeepSpeed's checkpoint works unconfigured, with the defaults
        _ACTIVE = ActivationCheckpointer(ActivationCheckpointingConfig())
    return _ACTIVE


def checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """DeepSpeed's ``deepspeed.checkpointing.checkpoint(function, *args)`` with the active settings."""
    return _active().checkpoint(function, *args)


def statistics() -> ActivationStatistics:
    """The active checkpointer's `ActivationStatistics`."""
    return _active().statistics()


def reset() -> None:
    """Close the active checkpointer (its NVMe file and buffers) and forget the configuration."""
    global _ACTIVE, _CONFIGURED
    if _ACTIVE is not None:
        _ACTIVE.close()
    _ACTIVE = None
    _CONFIGURED = False
