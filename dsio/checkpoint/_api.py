"""``await save(state, path)`` / ``await load(path)``: one safetensors file holding a whole state."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import AsyncIterator
from typing import Any

import torch

from ..config import IOConfig
from ..errors import CheckpointFormatError, CheckpointNotFoundError
from ..handle import AsyncIOHandle
from . import _fs
from ._format import Header
from ._integrity import FORMAT_KEY, STATE_KEY
from ._read import read_file, read_file_into
from ._state import flatten, unflatten
from ._write import FileWriter

__all__ = ["DEFAULT_IO", "file_metadata", "into_targets", "load", "restore", "save"]

#: The I/O configuration checkpoints use unless given another: deep queues, two workers.
DEFAULT_IO = IOConfig(block_size=1 << 20, queue_depth=32, intra_op_parallelism=2)
FORMAT_VERSION = "1"

PathLike = str | os.PathLike[str]


def file_metadata(tree: Any, extra: dict[str, str] | None = None) -> dict[str, str]:
    meta = {FORMAT_KEY: FORMAT_VERSION, STATE_KEY: json.dumps(tree, separators=(",", ":"))}
    if extra:
        meta.update(extra)
    return meta


@contextlib.asynccontextmanager
async def _handle(handle: AsyncIOHandle | None, config: IOConfig | None) -> AsyncIterator[AsyncIOHandle]:
    if handle is not None:
        yield handle
        return
    async with AsyncIOHandle(config or DEFAULT_IO) as h:
        yield h


async def save(
    state: Any,
    path: PathLike,
    *,
    allow_pickle: bool = False,
    fsync: bool = True,
    handle: AsyncIOHandle | None = None,
    config: IOConfig | None = None,
    metadata: dict[str, str] | None = None,
) -> int:
    """Write ``state`` (nested dicts/lists of tensors and plain values) to ``path``; return its size.
    ``metadata``: extra string entries of the safetensors header (e.g. ``{"format": "pt"}``, which
    Hugging Face's loaders check).

    The file is a valid safetensors file (``safetensors.torch.load_file`` returns the tensors) and
    is durable (fsynced) when this returns. It replaces ``path`` in place: for crash safety use
    ``Checkpointer``, which writes into a temporary directory and renames. Values JSON cannot
    hold raise ``UnsupportedStateError`` unless ``allow_pickle``.
    """
    tensors, tree = flatten(state, allow_pickle=allow_pickle)
    path = os.fspath(path)
    async with _handle(handle, config) as h:
        # One-shot: write straight from the tensors through the handle's small pinned pool rather
        # than allocating (and page-faulting) a state-sized staging region for a single use.
        w = FileWriter(h, path, tensors, file_metadata(tree, metadata), None)
        try:
            return await w.stream(fsync=fsync)
        except BaseException:
            await w.abort()
            raise


def restore(
    header: Header,
    tensors: dict[str, Any],
    *,
    device: str | torch.device,
    allow_pickle: bool,
    path: str,
) -> Any:
    """The state recorded in a file's header, built around its loaded tensors (or tensors left in
    the file: `StoredTensor`, CPU only)."""
    dev = torch.device(device)
    if dev.type != "cpu":
        tensors = {n: t.to(dev) for n, t in tensors.items()}
    raw = header.metadata.get(STATE_KEY)
    if raw is None:  # a stock safetensors file: a flat dict, in file order
        return tensors
    try:
        tree = json.loads(raw)
    except (json.JSONDecodeError, RecursionError) as e:
        raise CheckpointFormatError(
            f"{path}: state structure is not valid JSON ({type(e).__name__})"
        ) from None
    return unflatten(tree, tensors, allow_pickle=allow_pickle)


def into_targets(
    into: Any, device: str | torch.device, lazy_from: int | None, allow_pickle: bool
) -> dict[str, Any]:
    """The tensors of a load's ``into`` state by the names ``save`` gives them (``flatten``)."""
    if lazy_from is not None:
        raise ValueError("into= fills the given tensors; lazy_from= leaves tensors in the file: pick one")
    if torch.device(device).type != "cpu":
        raise ValueError(f"into= fills the given (CPU) tensors in place; got device={device!r}")
    tensors, _ = flatten(into, allow_pickle=allow_pickle)
    return dict(tensors)


async def load(
    path: PathLike,
    *,
    device: str | torch.device = "cpu",
    verify: bool = True,
    allow_pickle: bool = False,
    handle: AsyncIOHandle | None = None,
    config: IOConfig | None = None,
    lazy_from: int | None = None,
    into: Any = None,
) -> Any:
    """Read a state written by ``save`` (same structure back) or any safetensors file (a dict).

    ``verify`` checks each tensor's crc32c where the file records one (dsio's files);
    a mismatch is ``ChecksumError`` naming the tensor and the file. The CPU tensors returned are
    views of one allocation holding the file's tensors (any one of them keeps all of that memory
    alive: ``clone()`` one to keep it alone); a tensor stored at an offset its dtype cannot be
    viewed at (a foreign file) is copied out instead. A malformed or truncated
    file is ``CheckpointFormatError``. Nothing is unpickled unless ``allow_pickle``.

    ``lazy_from`` (with ``handle``, which they read with): tensors of at least that many bytes stay
    in the file as `StoredTensor`s (read byte range by byte range by their consumer, checksums
    checked as they are read in order; they keep the file open until they are all gone).

    ``into``: a state whose tensors are filled in place, as ``Checkpointer.load(into=)`` does
    (same names, dtypes and shapes as the file's; contiguous CPU tensors, no two sharing bytes);
    the state returned holds those tensors.
    """
    targets = None if into is None else into_targets(into, device, lazy_from, allow_pickle)
    if lazy_from is not None:
        if handle is None:
            raise ValueError("load(lazy_from=...) needs handle=: the stored tensors read with it")
        return await _load_lazy(os.fspath(path), handle, lazy_from, verify, allow_pickle)
    path = os.fspath(path)
    if os.path.isdir(path):
        raise CheckpointNotFoundError(f"no checkpoint file at {path} (a directory: Checkpointer reads those)")
    try:  # follows a symlink the caller named, but never blocks on a FIFO or reads a device
        fd = _fs.open_regular(path, follow=True)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"no checkpoint file at {path}") from None
    try:
        async with _handle(handle, config) as h:
            if targets is not None:
                header, filled = await read_file_into(h, path, targets, verify=verify, fd=fd)
                tensors: dict[str, Any] = dict(filled)
            else:
                header, tensors = await read_file(h, path, verify=verify, fd=fd)
    finally:
        os.close(fd)
    return restore(header, tensors, device=device, allow_pickle=allow_pickle, path=path)


async def _load_lazy(
    path: str, handle: AsyncIOHandle, lazy_from: int, verify: bool, allow_pickle: bool
) -> Any:
    from ._stored import StoredFile, StoredTensor

    if os.path.isdir(path):
        raise CheckpointNotFoundError(f"no checkpoint file at {path} (a directory: Checkpointer reads those)")
    try:
        fd = _fs.open_regular(path, follow=True)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"no checkpoint file at {path}") from None
    stored = StoredFile(fd, path)
    try:
        header, tensors = await read_file(
            handle, path, verify=verify, fd=fd, lazy_from=lazy_from, stored=stored
        )
    except BaseException:
        stored.close()
        raise
    if not any(isinstance(t, StoredTensor) for t in tensors.values()):
        stored.close()
    return restore(header, tensors, device="cpu", allow_pickle=allow_pickle, path=path)
