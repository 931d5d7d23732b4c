"""dsio.checkpoint: async, crash-safe, safetensors-compatible checkpoints.

    await dsio.checkpoint.save(state, "/data/model.safetensors")     # one durable safetensors file
    state = await dsio.checkpoint.load("/data/model.safetensors")    # also reads stock safetensors

    ckpt = dsio.checkpoint.Checkpointer("/data/run1", keep_last=3)
    task = await ckpt.save(step, state)   # returns at once; the state is copied in the background
    await ckpt.wait_staged()              # before changing the state (e.g. before optimizer.step())
    await task                            # durable and committed
    state = await ckpt.load()             # latest committed; ckpt.load(step=1200); ckpt.steps()

A state may hold ``LazyTensor`` sources (e.g. ``FileRegions`` of swap files) where it holds tensors:
they are stored as ordinary tensors but streamed through a few fixed windows, never all in memory.
``save(..., background_staging=True, touch_order=[[MemorySpan | FileSpan, ...], ...])`` streams them
in the order the caller will change them; ``staging_capture.future(i)`` says when set ``i`` is free.

``SliceReader`` / ``read_slices`` read element ranges of named tensors of any safetensors file
(Hugging Face's or dsio's) straight into caller-provided tensors: only those bytes are read.

Rank files written by other means (dstrain's ``torch.save`` fallback) are committed through the same
protocol: ``write_rank_file(os.path.join(step_tmp_dir(root, step), name), fill)`` on each rank, then
``commit_written(root, step, names)`` on rank 0.

``dsio.checkpoint.dcp`` holds ``DsioStorageWriter`` / ``DsioStorageReader`` for
``torch.distributed.checkpoint`` (imported on first use).
"""

from typing import Any

from ..errors import (
    CheckpointFormatError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    ChecksumError,
    SliceRangeError,
    TensorNotFoundError,
    UnsupportedStateError,
)
from ._api import DEFAULT_IO, load, save
from ._capture import Capture, FileSpan, MemorySpan, TouchOrder
from ._errors import CheckpointCommitError, CheckpointLockedError, LatestNotUpdatedError, StateChangedError
from ._finish import commit_written, step_tmp_dir, write_rank_file
from ._lazy import FileRegions, LazyTensor
from ._slices import SliceReader, TensorInfo, TensorSlice, read_slices
from ._stored import StoredTensor
from .checkpointer import Checkpointer, CheckpointStatistics, SaveResult

__all__ = [
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


def __getattr__(name: str) -> Any:
    # torch.distributed.checkpoint is heavy to import: only when the DCP plugin is asked for.
    if name in ("DsioStorageReader", "DsioStorageWriter", "dcp"):
        import importlib

        dcp = importlib.import_module(f"{__name__}.dcp")
        return dcp if name == "dcp" else getattr(dcp, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
