"""``torch.distributed.checkpoint`` storage on dsio: ``DsioStorageWriter`` / ``DsioStorageReader``.

    dcp.save(state_dict, storage_writer=DsioStorageWriter("/data/ckpt"))
    dcp.async_save(state_dict, storage_writer=DsioStorageWriter("/data/ckpt"))
    dcp.load(state_dict, storage_reader=DsioStorageReader("/data/ckpt"))

Each rank writes one file ``__<i>_0.distcp`` of raw tensor bytes: its items are copied into one
page-aligned region laid out as the file and written with large O_DIRECT writes, then fsynced.
Every item records dtype, shape and a crc32c that the reader verifies (``ChecksumError``).
``.metadata`` is DCP's pickled ``Metadata`` (what DCP itself writes), written atomically; the
reader unpickles it with an allowlist of DCP's metadata classes only, and rejects storage entries
naming files outside the checkpoint directory.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import io
import os
import pickle
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from ..config import IOConfig
from ..errors import CheckpointFormatError, ChecksumError
from ..handle import AsyncIOHandle
from . import _commit
from ._api import DEFAULT_IO
from ._format import DTYPES, dtype_name
from ._integrity import crc_of
from ._read import _placed
from ._write import Staging

__all__ = ["DsioStorageInfo", "DsioStorageReader", "DsioStorageWriter"]

METADATA = ".metadata"
_ITEM_ALIGN = 64
T = TypeVar("T")


@dataclass(frozen=True)
class DsioStorageInfo:
    """Where one saved item lives: file, byte range, and what it is."""

    relative_path: str
    offset: int
    length: int
    crc32c: int
    dtype: str | None = None
    """safetensors dtype name of a tensor item; None for a bytes item."""
    shape: tuple[int, ...] | None = None


def _run(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion from synchronous DCP code, with or without a loop in this thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dsio-dcp") as ex:
        return ex.submit(asyncio.run, coro).result()


def _done(value: Any) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut


class DsioStorageWriter(StorageWriter):
    """DCP ``StorageWriter`` writing through dsio (O_DIRECT, io_uring/AIO) with fsync."""

    def __init__(
        self, path: str | os.PathLike[str], *, config: IOConfig | None = None, sync_files: bool = True
    ) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.config = config or DEFAULT_IO
        self.sync_files = sync_files
        self.save_id = uuid.uuid4().hex
        self.is_coordinator = False
        self.rank: int | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        os.makedirs(self.path, exist_ok=True)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(p, storage_data=f"__{i}_0.distcp") for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        name = plan.storage_data if isinstance(plan.storage_data, str) else f"__{self.rank or 0}_0.distcp"
        items: list[tuple[WriteItem, Any]] = [(it, planner.resolve_data(it)) for it in plan.items]
        return _done(_run(self._write(name, items)))

    async def _write(self, name: str, items: list[tuple[WriteItem, Any]]) -> list[WriteResult]:
        # Lay the items out back to back (64-byte aligned, so each can be viewed with its dtype).
        placed = []
        pos = 0
        for item, data in items:
            if item.type == WriteItemType.BYTE_IO:
                buf = data.getbuffer() if isinstance(data, io.BytesIO) else memoryview(data)
                src: Any = torch.frombuffer(bytearray(buf), dtype=torch.uint8) if len(buf) else None
                n = len(buf)
            else:
                src = data.detach()
                if dtype_name(src.dtype) is None:
                    raise TypeError(f"DCP item {item.index.fqn}: dtype {src.dtype} is not supported")
                n = src.numel() * src.element_size()
            placed.append((item, src, pos, n))
            pos = -(-(pos + n) // _ITEM_ALIGN) * _ITEM_ALIGN
        total = pos
        staging = Staging()
        try:
            region = staging.get(total)
            results = []
            for item, src, off, n in placed:
                if n:
                    if item.type == WriteItemType.BYTE_IO:
                        region[off : off + n].copy_(src)
                    else:
                        region[off : off + n].view(src.dtype).view(src.shape).copy_(src)
                crc = crc_of(region.data_ptr() + off, n)
                tensor = item.type != WriteItemType.BYTE_IO
                info = DsioStorageInfo(
                    name,
                    off,
                    n,
                    crc,
                    dtype_name(src.dtype) if tensor else None,
                    tuple(src.shape) if tensor else None,
                )
                results.append(WriteResult(index=item.index, size_in_bytes=n, storage_data=info))
            async with AsyncIOHandle(self.config) as h:
                await h.pwrite(region, os.path.join(self.path, name), fsync=self.sync_files)
            return results
        finally:
            staging.release()

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.storage_data = {wr.index: wr.storage_data for rs in results for wr in rs}
        metadata.storage_meta = self.storage_meta()
        data = pickle.dumps(metadata)
        tmp = os.path.join(self.path, METADATA + ".tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            if self.sync_files:
                os.fsync(f.fileno())
        os.replace(tmp, os.path.join(self.path, METADATA))
        if self.sync_files:
            _commit.fsync_dir(self.path)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


_ALLOWED_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner")
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    (__name__, "DsioStorageInfo"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),  # a stock checkpoint: refused later, clearly
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP ``Metadata`` and nothing else: no arbitrary callables, no code."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or module in _ALLOWED_MODULES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointFormatError(f"{METADATA} refers to {module}.{name}, which DCP metadata never holds")


class DsioStorageReader(StorageReader):
    """DCP ``StorageReader`` for checkpoints written by ``DsioStorageWriter``; verifies crc32c."""

    def __init__(
        self, path: str | os.PathLike[str], *, config: IOConfig | None = None, verify: bool = True
    ) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.config = config or DEFAULT_IO
        self.verify = verify
        self.storage_data: dict[MetadataIndex, DsioStorageInfo] = {}
        self.load_id = uuid.uuid4().hex

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.storage_data = {}
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
        self.load_id = uuid.uuid4().hex

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = os.path.join(self.path, METADATA)
        with open(path, "rb") as f:
            try:
                md = _MetadataUnpickler(f).load()
            except CheckpointFormatError:
                raise
            except Exception as e:
                raise CheckpointFormatError(f"{path}: not valid DCP metadata ({e!r})") from None
        if not isinstance(md, Metadata):
            raise CheckpointFormatError(f"{path}: holds {type(md).__name__}, not DCP Metadata")
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        data = metadata.storage_data
        if not isinstance(data, dict):
            raise CheckpointFormatError(f"{self.path}: metadata has no storage data")
        for idx, info in data.items():
            if not isinstance(info, DsioStorageInfo):
                raise CheckpointFormatError(
                    f"{self.path}: item {idx.fqn} was not written by DsioStorageWriter ({type(info).__name__})"
                )
            _commit.inside(self.path, info.relative_path, f"{self.path}/{METADATA}")
        self.storage_data = data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        _run(self._read(plan, planner))
        return _done(None)

    async def _read(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        async with AsyncIOHandle(self.config) as h:
            files: dict[str, Any] = {}
            try:

                async def one(req: ReadItem) -> None:
                    info = self.storage_data[req.storage_index]
                    path = os.path.join(self.path, info.relative_path)
                    f = files.get(path)
                    if f is None:
                        f = files[path] = h.open(path, "r")
                    raw = _placed(info.length, info.offset)
                    if info.length:
                        await f.pread(raw, info.offset)
                    if self.verify and crc_of(raw.data_ptr(), info.length) != info.crc32c:
                        raise ChecksumError(
                            f"item {req.storage_index.fqn!r} in {path}: crc32c mismatch (corrupted file)"
                        )
                    if req.type == LoadItemType.BYTE_IO:
                        planner.load_bytes(req, io.BytesIO(raw.numpy().tobytes()))
                        return
                    if info.dtype not in DTYPES or info.shape is None:
                        raise CheckpointFormatError(
                            f"{path}: item {req.storage_index.fqn!r} has no dtype/shape"
                        )
                    dtype = DTYPES[info.dtype]
                    if raw.data_ptr() % torch.empty(0, dtype=dtype).element_size():
                        raw = raw.clone()
                    saved = raw.view(dtype).view(info.shape)
                    src = narrow_tensor_by_index(saved, req.storage_offsets, req.lengths)
                    target = planner.resolve_tensor(req).detach()
                    if target.size() != src.size():
                        raise CheckpointFormatError(
                            f"item {req.storage_index.fqn!r}: stored {tuple(src.size())}, "
                            f"expected {tuple(target.size())}"
                        )
                    target.copy_(src)
                    planner.commit_tensor(req, target)

                tasks = [asyncio.ensure_future(one(r)) for r in plan.items]
                if tasks:
                    await asyncio.wait(tasks)
                    for t in tasks:
                        if t.exception() is not None:
                            raise t.exception()  # type: ignore[misc]
            finally:
                for f in files.values():
                    f.close()

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))
