"""`checkpoint(fn, *args)`: run ``fn`` without keeping its inside for backward, recompute it there.

DeepSpeed's (Megatron's) reentrant scheme: forward runs ``fn`` under ``no_grad`` and keeps only its
inputs, in the configured `Store`; backward takes the inputs back, replays the RNG state forward saw
(dropout draws the same mask), reruns ``fn`` with gradients and back-propagates through it. The
recompute does the same arithmetic as a forward without checkpointing, so losses and gradients are
equal bit for bit.

One `ActivationCheckpointer` is active per process (DeepSpeed's module-level API): `configure` sets it
(`dstrain.initialize` does, from the config's ``activation_checkpointing`` section), `reset` closes it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dstrain.checkpointing import rng
from dstrain.checkpointing.config import ActivationCheckpointingConfig
from dstrain.checkpointing.stores import DeviceStore, HostStore, NvmeStore, Saved, Store
from dstrain.errors import ConfigError, NotImplementedConfigError

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
    """With ``profile``: time in recomputes (backward through them included); 0 otherwise."""


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
        self._dummy = torch.empty((), requires_grad=True)  # makes the output require grad (see checkpoint)
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
        if not torch.is_grad_enabled():  # nothing will run backward: nothing to keep
            return function(*args)
        return _CheckpointFunction.apply(function, self, self._dummy, *args)

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


def _tensors_out(outputs: Any) -> tuple[Any, ...]:
    return outputs if isinstance(outputs, tuple) else (outputs,)


class _CheckpointFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, run: Callable[..., Any], ckpt: ActivationCheckpointer, dummy: torch.Tensor, *args: Any
    ):
        ctx.run, ctx.ckpt = run, ckpt
        ctx.rng = rng.capture()
        ckpt.boundary()
        start = time.perf_counter()
        with torch.no_grad():
            outputs = run(*args)
        ckpt.boundary()
        if ckpt.config.profile:
            ckpt.forward_seconds += time.perf_counter() - start
        ckpt.checkpoints += 1
        ctx.saved = ckpt.store.save(args)
        ctx.mark_non_differentiable(
            *[o for o in _tensors_out(outputs) if isinstance(o, torch.Tensor) and not o.is_floating_point()]
        )
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        ckpt: ActivationCheckpointer = ctx.ckpt
        saved: Saved = ctx.saved
        inputs = ckpt.store.load(saved)
        ctx.saved = None
        ckpt.boundary()
        start = time.perf_counter()
        with rng.replay(ctx.rng), torch.enable_grad():
            outputs = _tensors_out(ctx.run(*inputs))
            pairs = [
                (o, g)
                for o, g in zip(outputs, grads, strict=False)
                if isinstance(o, torch.Tensor) and o.requires_grad and g is not None
            ]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        ckpt.boundary()
        if ckpt.config.profile:
            ckpt.recompute_seconds += time.perf_counter() - start
        ckpt.recomputes += 1
        grads_in = tuple(x.grad if isinstance(x, torch.Tensor) and x.requires_grad else None for x in inputs)
        return (None, None, None, *grads_in)


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
