"""``IOConfig``: how an :class:`~dsio.AsyncIOHandle` talks to the disk."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError

__all__ = ["ALIGNMENT", "BACKENDS", "GPU_BACKENDS", "IOConfig"]

#: Memory address, file offset and length granule for O_DIRECT. 4096 covers
#: devices with 512-byte and 4 KiB logical blocks alike.
ALIGNMENT = 4096
BACKENDS = ("auto", "io_uring", "aio", "posix")
GPU_BACKENDS = ("auto", "cufile", "bounce")


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return value


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
            raise ConfigError(f"block_size must be a power of two >= 4096, got {bs}")
        if _check_int("queue_depth", self.queue_depth) < 1 or self.queue_depth > 4096:
            raise ConfigError(f"queue_depth must be in 1..4096, got {self.queue_depth}")
        par = _check_int("intra_op_parallelism", self.intra_op_parallelism)
        if par < 1 or par > 256:
            raise ConfigError(f"intra_op_parallelism must be in 1..256, got {par}")
        for name in ("single_submit", "overlap_events", "o_direct"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {', '.join(BACKENDS)}; got {self.backend!r}")
        if self.gpu_backend not in GPU_BACKENDS:
            raise ConfigError(
                f"gpu_backend must be one of {', '.join(GPU_BACKENDS)}; got {self.gpu_backend!r}"
            )
        sb = _check_int("staging_buffer_bytes", self.staging_buffer_bytes)
        if sb < 4096 or sb % 4096:
            raise ConfigError(f"staging_buffer_bytes must be a positive multiple of 4096, got {sb}")
        pb = _check_int("pool_bytes", self.pool_bytes)
        if pb % 4096 or pb < sb:
            raise ConfigError(
                f"pool_bytes must be a multiple of 4096 and at least staging_buffer_bytes ({sb}), got {pb}"
            )
