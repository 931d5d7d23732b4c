"""The public surface of dsio.checkpoint is pinned."""

import dsio.checkpoint as C


def test_public_surface():
    assert sorted(C.__all__) == sorted(
        [
            "DEFAULT_IO",
            "Capture",
            "CheckpointCommitError",
            "CheckpointFormatError",
            "CheckpointLockedError",
            "CheckpointMismatchError",
            "CheckpointNotFoundError",
            "CheckpointStatistics",
            "Checkpointer",
            "ChecksumError",
            "DsioStorageReader",
            "DsioStorageWriter",
            "FileRegions",
            "FileSpan",
            "LatestNotUpdatedError",
            "LazyTensor",
            "MemorySpan",
            "SaveResult",
            "SliceRangeError",
            "SliceReader",
            "StateChangedError",
            "StoredTensor",
            "TensorInfo",
            "TensorNotFoundError",
            "TensorSlice",
            "TouchOrder",
            "UnsupportedStateError",
            "commit_written",
            "load",
            "read_slices",
            "save",
            "step_tmp_dir",
            "write_rank_file",
        ]
    )
    for name in C.__all__:
        assert getattr(C, name) is not None
    from dsio.checkpoint import dcp

    assert C.DsioStorageWriter is dcp.DsioStorageWriter and dcp.__all__
