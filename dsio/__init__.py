"""dsio: asyncio-native tensor I/O (io_uring, Linux AIO, cuFile), async checkpoints.

async with dsio.AsyncIOHandle(dsio.IOConfig(queue_depth=32)) as h:
    await h.pwrite(tensor, "/data/t.bin")
    await h.pread(tensor, "/data/t.bin")
"""

from typing import TYPE_CHECKING

from ._backends import BackendStatus, backend_status
from ._gather import all_done, wait_all, wait_all_futures
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

if TYPE_CHECKING:  # loaded on first use (module __getattr__ below)
    from ._bridge import LoopThread, is_exiting, run_sync, shared_loop

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
    "all_done",
    "backend_status",
    "LoopThread",
    "is_exiting",
    "run_sync",
    "shared_loop",
    "wait_all",
    "wait_all_futures",
    "__version__",
]

_SUBMODULES = ("checkpoint", "compat", "gpu", "metrics", "cli")
#: The one bridge for synchronous callers (dsio._bridge), loaded on first use: its exit hooks are
#: registered when it is imported, after concurrent.futures' (see dsio._bridge).
_BRIDGE = ("LoopThread", "is_exiting", "run_sync", "shared_loop")


def __getattr__(name: str):
    """``dsio.checkpoint``, ``dsio.compat``, ... load on first use (torch.distributed, CUDA and
    prometheus-client stay out of ``import dsio``); so does the sync bridge (`run_sync`, ...)."""
    if name in _SUBMODULES:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    if name in _BRIDGE:
        from . import _bridge

        return getattr(_bridge, name)
    raise AttributeError(f"module 'dsio' has no attribute {name!r}")
