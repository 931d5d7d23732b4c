"""dsio's public surface is pinned: adding or removing a name is a deliberate change here."""

from __future__ import annotations

import dsio

PUBLIC = {
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
    "HandleStatistics",
    "IOConfig",
    "IOEngineStatistics",
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
}


def test_exports_are_pinned():
    assert set(dsio.__all__) == PUBLIC
    for name in dsio.__all__:
        assert hasattr(dsio, name)


def test_every_exported_error_is_a_documented_dsio_error():
    for name in dsio.__all__:
        obj = getattr(dsio, name)
        if isinstance(obj, type) and issubclass(obj, Exception) and obj is not dsio.DsioError:
            assert issubclass(obj, dsio.DsioError) and obj.__doc__


def test_engine_statistics_name_is_dsio_specific():
    # dstrain has its own EngineStatistics (the training engine); dsio's is the I/O engine's.
    assert not hasattr(dsio, "EngineStatistics")
    assert dsio.IOEngineStatistics.__name__ == "IOEngineStatistics"
