"""``IOConfig``: how an :class:`~dsio.AsyncIOHandle` talks to the disk."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError

__all__ = ["ALIGNMENT", "BACKENDS", "DEEPSPEED_AIO_DEFAULTS", "GPU_BACKENDS", "IOConfig"]

#: Memory address, file offset and length granule for O_DIRECT. 4096 covers
#: devices with 512-byte and 4 KiB logical blocks alike.
ALIGNMENT = 4096
BACKENDS = ("auto", "io_uring", "aio", "posix")
GPU_BACKENDS = ("auto", "cufile", "bounce")


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an int, got {type(value).__name__} {value!r}", field=name)
    return value


#: DeepSpeed's defaults for its ``"aio"`` block (deepspeed/runtime/swap_tensor/constants.py,
#: 0.19.8): a key missing from a DeepSpeed config means this value there, so it means it here too.
DEEPSPEED_AIO_DEFAULTS: Mapping[str, Any] = {
    "block_size": 1_048_576,
    "queue_depth": 8,
    "intra_op_parallelism": 1,
    "single_submit": False,
    "overlap_events": True,
    "use_gds": False,
}
#: DeepSpeed's older spelling of ``intra_op_parallelism``.
_DEEPSPEED_ALIASES = {"thread_count": "intra_op_parallelism"}


@dataclass(frozen=True, kw_only=True, slots=True)
class IOConfig:
    block_size: int = 1 << 20
    """Bytes per piece a request is split into: a power of two, at least 4096."""

    queue_depth: int = 64
    """Pieces each worker keeps in flight in the kernel (at least 1)."""

    intra_op_parallelism: int = 2
    """Worker threads; each owns one io_uring ring or one AIO context (at least 1)."""

    single_submit: bool = False
    """True: one submit syscall per piece. False: every ready piece in one syscall."""

    overlap_events: bool = True
    """True: refill the queue as each piece completes (sliding window). False: lock-step
    batches of ``queue_depth`` pieces, each waited for in full (DeepSpeed's default)."""

    backend: str = "auto"
    """``"auto"`` (io_uring, then aio, then posix), ``"io_uring"``, ``"aio"`` or ``"posix"``."""

    o_direct: bool = True
    """Open files with O_DIRECT where the filesystem allows it (falls back, logged, where not)."""

    pool_bytes: int = 64 << 20
    """Size of the handle's pinned staging pool (for unaligned memory); multiple of 4096."""

    staging_buffer_bytes: int = 8 << 20
    """Size of one staging buffer (the chunk a staged transfer moves at a time)."""

    gpu_backend: str = "auto"
    """CUDA tensors: ``"auto"``, ``"cufile"`` (GPUDirect Storage) or ``"bounce"`` (pinned host buffers)."""

    def __post_init__(self) -> None:
        bs = _check_int("block_size", self.block_size)
        if bs < 4096 or not _pow2(bs):
            raise ConfigError(f"block_size must be a power of two >= 4096, got {bs}", field="block_size")
        if _check_int("queue_depth", self.queue_depth) < 1 or self.queue_depth > 4096:
            raise ConfigError(f"queue_depth must be in 1..4096, got {self.queue_depth}", field="queue_depth")
        par = _check_int("intra_op_parallelism", self.intra_op_parallelism)
        if par < 1 or par > 256:
            raise ConfigError(
                f"intra_op_parallelism must be in 1..256, got {par}", field="intra_op_parallelism"
            )
        for name in ("single_submit", "overlap_events", "o_direct"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be a bool, got {getattr(self, name)!r}", field=name)
        if self.backend not in BACKENDS:
            raise ConfigError(
                f"backend must be one of {', '.join(BACKENDS)}; got {self.backend!r}", field="backend"
            )
        if self.gpu_backend not in GPU_BACKENDS:
            raise ConfigError(
                f"gpu_backend must be one of {', '.join(GPU_BACKENDS)}; got {self.gpu_backend!r}",
                field="gpu_backend",
            )
        sb = _check_int("staging_buffer_bytes", self.staging_buffer_bytes)
        if sb < 4096 or sb % 4096:
            raise ConfigError(
                f"staging_buffer_bytes must be a positive multiple of 4096, got {sb}",
                field="staging_buffer_bytes",
            )
        pb = _check_int("pool_bytes", self.pool_bytes)
        if pb % 4096 or pb < sb:
            raise ConfigError(
                f"pool_bytes must be a multiple of 4096 and at least staging_buffer_bytes ({sb}), got {pb}",
                field="pool_bytes",
            )

    # -- DeepSpeed's "aio" block: this is its one parser ---------------------------------------
    @classmethod
    def from_deepspeed(cls, aio: Mapping[str, Any] | None, **overrides: Any) -> IOConfig:
        """The ``IOConfig`` a DeepSpeed ``"aio"`` config block describes (the block itself, not the
        whole config: ``IOConfig.from_deepspeed(ds_config.get("aio"))``).

        Keys: DeepSpeed's ``block_size``, ``queue_depth``, ``intra_op_parallelism`` (older
        spelling ``thread_count``), ``single_submit``, ``overlap_events`` and ``use_gds``
        (True: ``gpu_backend="cufile"``; False: ``"bounce"``; absent: dsio's ``"auto"``); dsio's
        own field names (``backend``, ``o_direct``, ``pool_bytes``, ...) are accepted as
        extensions. A key that is absent takes DeepSpeed's default
        (:data:`DEEPSPEED_AIO_DEFAULTS`: queue depth 8, one thread, overlap on), so a DeepSpeed
        config means the same here as there; ``None`` (no block) is all defaults.
        ``overrides`` are IOConfig fields set after the block (e.g. ``pool_bytes``).

        Validation is exactly what a handle accepts (``block_size`` a power of two >= 4096, not
        DeepSpeed's 512), at parse time rather than when a handle opens. Every problem raises
        :class:`~dsio.ConfigError` whose ``field`` is the offending key of the block.
        """
        if aio is None:
            aio = {}
        if not isinstance(aio, Mapping):
            raise ConfigError(f'the "aio" block must be a JSON object, got {type(aio).__name__}', field="aio")
        own = {f.name for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {k: v for k, v in DEEPSPEED_AIO_DEFAULTS.items() if k != "use_gds"}
        seen: dict[str, str] = {}
        for key, value in aio.items():
            if not isinstance(key, str):
                raise ConfigError(f'"aio" keys must be strings, got {key!r}', field=repr(key))
            name = _DEEPSPEED_ALIASES.get(key, key)
            if name in seen:
                raise ConfigError(f'"aio" gives {name} twice (as {seen[name]!r} and {key!r})', field=key)
            seen[name] = key
            if value is None:
                raise ConfigError(f'"aio".{key} is null; give a value or leave the key out', field=key)
            if name == "use_gds":
                if not isinstance(value, bool):
                    raise ConfigError(f'"aio".use_gds must be a bool, got {value!r}', field=key)
                values["gpu_backend"] = "cufile" if value else "bounce"
            elif name in own:
                values[name] = value
            else:
                accepted = ", ".join([*DEEPSPEED_AIO_DEFAULTS, "thread_count", "(IOConfig fields)"])
                raise ConfigError(f'unknown "aio" key {key!r} (accepted: {accepted})', field=key)
        for name in overrides:
            if name not in own:
                raise ConfigError(f"unknown IOConfig field {name!r}", field=name)
        values.update(overrides)
        try:
            return cls(**values)
        except ConfigError as e:
            where: str | None = seen.get(e.field or "", e.field)
            raise ConfigError(f'"aio".{where}: {e}', field=where) from None

    def to_deepspeed(self) -> dict[str, Any]:
        """This config as a DeepSpeed ``"aio"`` block (the inverse of :meth:`from_deepspeed` for
        DeepSpeed's keys; dsio-only fields such as ``backend`` are added when not the default)."""
        block: dict[str, Any] = {
            "block_size": self.block_size,
            "queue_depth": self.queue_depth,
            "intra_op_parallelism": self.intra_op_parallelism,
            "single_submit": self.single_submit,
            "overlap_events": self.overlap_events,
        }
        if self.gpu_backend != "auto":
            block["use_gds"] = self.gpu_backend == "cufile"
        default = IOConfig()
        for name in ("backend", "o_direct", "pool_bytes", "staging_buffer_bytes"):
            if getattr(self, name) != getattr(default, name):
                block[name] = getattr(self, name)
        return block
