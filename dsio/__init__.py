"""dsio: asyncio-native tensor I/O (io_uring, Linux AIO, cuFile), async checkpoints.

async with dsio.AsyncIOHandle(dsio.IOConfig(queue_depth=32)) as h:
    await h.pwrite(tensor, "/data/t.bin")
    await h.pread(tensor, "/data/t.bin")
"""

from ._backends import BackendStatus, backend_status
from ._stats import LATENCY_BUCKET_BOUNDS_S, HandleStatistics, IOEngineStatistics, OpStatistics
from .config import ALIGNMENT, IOConfig
from .errors import (
    AlignmentError,
    BackendUnavailableError,
    CheckpointFormatError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    ChecksumError,
    ClosedError,
    ConfigError,
    DsioError,
    IOFailedError,
    OffsetError,
    PoolBusyError,
    ShortIOError,
    SliceRangeError,
    TensorLayoutError,
    TensorNotFoundError,
    UnsupportedStateError,
    WrongLoopError,
)
from .file import AsyncFile
from .handle import AsyncIOHandle
from .pool import Lease, PinnedPool, PoolStatistics

__version__ = "0.1.0"

__all__ = [
    "ALIGNMENT",
    "LATENCY_BUCKET_BOUNDS_S",
    "AlignmentError",
    "AsyncFile",
    "AsyncIOHandle",
    "BackendStatus",
    "BackendUnavailableError",
    "CheckpointFormatError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "ChecksumError",
    "ClosedError",
    "ConfigError",
    "DsioError",
    "IOEngineStatistics",
    "HandleStatistics",
    "IOConfig",
    "IOFailedError",
    "Lease",
    "OffsetError",
    "OpStatistics",
    "PinnedPool",
    "PoolBusyError",
    "PoolStatistics",
    "ShortIOError",
    "SliceRangeError",
    "TensorLayoutError",
    "TensorNotFoundError",
    "UnsupportedStateError",
    "WrongLoopError",
    "backend_status",
    "__version__",
]

_SUBMODULES = ("checkpoint", "compat", "gpu", "metrics", "cli")


def __getattr__(name: str):
    """``dsio.checkpoint``, ``dsio.compat``, ... load on first use (torch.distributed, CUDA and
    prometheus-client stay out of ``import dsio``)."""
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'dsio' has no attribute {name!r}")
