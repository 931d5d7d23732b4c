"""``torch.distributed.checkpoint`` storage on dsio: ``DsioStorageWriter`` / ``DsioStorageReader``.

    dcp.save(state_dict, storage_writer=DsioStorageWriter("/data/ckpt"))
    dcp.async_save(state_dict, storage_writer=DsioStorageWriter("/data/ckpt"))
    dcp.load(state_dict, storage_reader=DsioStorageReader("/data/ckpt"))

Interoperable both ways with stock DCP: ``DsioStorageWriter`` writes the layout of DCP's own
``FileSystemWriter`` (each rank one ``__<i>_0.distcp`` file, each tensor item a ``torch.save``
record, ``.metadata`` the pickled ``Metadata`` with ``_StorageInfo`` entries), so stock
``FileSystemReader`` loads it; ``DsioStorageReader`` loads stock checkpoints, its own, and the raw
layout of earlier dsio versions (``DsioStorageInfo``).

The writer serialises each tensor straight into one page-aligned region laid out as the file
(``torch.save`` into a counting sink for the size, then into the region: one memcpy, no CRC-32
pass of torch's zip writer) and writes it with large O_DIRECT writes, fsynced. Each item also
records a crc32c (an extra attribute of its ``_StorageInfo`` that stock DCP ignores) which
``DsioStorageReader`` verifies (``ChecksumError``). ``.metadata`` is written atomically (temp +
fsync + rename + directory fsync).

The reader unpickles ``.metadata`` with an allowlist of exact fully qualified names (as
``torch.load(weights_only=True)`` does): no module-wide allowance, no dotted-name lookups, so
nothing but DCP's metadata classes can be constructed. Every file of the checkpoint is opened
with ``O_NOFOLLOW | O_NONBLOCK`` and checked to be a regular file; every storage entry is
validated (plain file name, offsets within the file) before a byte is read.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import os
import pickle
import uuid
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import _StorageInfo
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

from .._bridge import run_sync
from .._gather import wait_all
from ..config import IOConfig
from ..errors import CheckpointFormatError, ChecksumError
from ..handle import AsyncIOHandle
from . import _fs
from ._api import DEFAULT_IO
from ._dcp_records import Sink, no_zip_crc32, savable
from ._format import DTYPES, dtype_name
from ._integrity import crc_of
from ._read import placed
from ._write import Staging

__all__ = ["DsioStorageInfo", "DsioStorageReader", "DsioStorageWriter"]

METADATA = ".metadata"
_ITEM_ALIGN = 64
#: ``.metadata`` grows with the number of items; a file bigger than this is not one.
MAX_METADATA_BYTES = 1 << 30


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


def recorded_crc32c(info: DsioStorageInfo | _StorageInfo) -> int | None:
    """An item's crc32c: `DsioStorageInfo`'s field, or the attribute `DsioStorageWriter` adds to torch's
    ``_StorageInfo`` (which stock ``FileSystemWriter``'s entries do not carry: None)."""
    if isinstance(info, DsioStorageInfo):
        return info.crc32c
    return getattr(info, "crc32c", None)  # torch's class, which does not declare the attribute


def _done(value: Any) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut


class DsioStorageWriter(StorageWriter):
    """DCP ``StorageWriter`` writing through dsio (O_DIRECT, io_uring/AIO) with fsync, in the
    layout of stock ``FileSystemWriter`` (readable by ``FileSystemReader``)."""

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
        return _done(run_sync(self._write(name, items)))

    async def _write(self, name: str, items: list[tuple[WriteItem, Any]]) -> list[WriteResult]:
        # Bytes first, then tensors (as FileSystemWriter orders them), back to back.
        items = sorted(items, key=lambda it: it[0].type != WriteItemType.BYTE_IO)
        placed = []
        pos = 0
        with no_zip_crc32():
            for item, data in items:
                if item.type == WriteItemType.BYTE_IO:
                    buf = data.getbuffer() if isinstance(data, io.BytesIO) else memoryview(data)
                    src: Any = bytes(buf)
                    n = len(src)
                else:
                    src = savable(data)
                    if dtype_name(src.dtype) is None and src.dtype not in (torch.complex128,):
                        raise TypeError(f"DCP item {item.index.fqn}: dtype {src.dtype} is not supported")
                    sink = Sink()
                    torch.save(src, sink)  # type: ignore[arg-type]  # a write-only file
                    n = sink.pos
                placed.append((item, src, pos, n))
                pos += n
            total = pos
            staging = Staging()
            try:
                region = staging.get(total)
                base = region.data_ptr()
                results = []
                for item, src, off, n in placed:
                    if item.type == WriteItemType.BYTE_IO:
                        if n:
                            region[off : off + n].copy_(torch.frombuffer(bytearray(src), dtype=torch.uint8))
                    else:
                        sink = Sink(base + off, n)
                        torch.save(src, sink)  # type: ignore[arg-type]  # a write-only file
                        if sink.pos != n:
                            raise RuntimeError("torch.save produced fewer bytes than it did a moment ago")
                    info = _StorageInfo(name, off, n)
                    info.crc32c = crc_of(base + off, n)  # type: ignore[attr-defined]
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
        if self.sync_files:
            _fs.write_durable(tmp, data)
        else:
            with open(tmp, "wb") as f:
                f.write(data)
        _fs.rename(tmp, os.path.join(self.path, METADATA))
        if self.sync_files:
            _fs.fsync_dir(self.path)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


_META = "torch.distributed.checkpoint.metadata"
#: Exactly the globals DCP metadata holds (as torch.load(weights_only=True) allows exact names).
_ALLOWED: frozenset[tuple[str, str]] = frozenset(
    {
        (_META, "Metadata"),
        (_META, "MetadataIndex"),
        (_META, "StorageMeta"),
        (_META, "TensorStorageMetadata"),
        (_META, "BytesStorageMetadata"),
        (_META, "ChunkStorageMetadata"),
        (_META, "TensorProperties"),
        (_META, "_MEM_FORMAT_ENCODING"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib._local", "PosixPath"),
        ("pathlib._local", "PurePosixPath"),
        (__name__, "DsioStorageInfo"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    }
    | {("torch", n) for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype)}
)


def _enum_member(cls: Any, name: Any) -> Any:
    """What ``builtins.getattr`` may do in DCP metadata: look up a member of an allowed Enum.

    Some Pythons (3.11.2 here) pickle an enum member as ``getattr(EnumClass, "NAME")`` (3.11.7:
    ``EnumClass(value)``), so metadata written there holds a ``getattr`` call. Anything
    but an allowlisted Enum class and one of its member names is refused.
    """
    if not (
        isinstance(cls, type)
        and issubclass(cls, enum.Enum)
        and (cls.__module__, cls.__qualname__) in _ALLOWED
        and isinstance(name, str)
        and name in cls.__members__
    ):
        raise CheckpointFormatError(
            f"{METADATA} calls getattr on something other than an allowed enum member"
        )
    return cls[name]


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP ``Metadata`` and nothing else: exact names only, no callables, no code
    (``getattr`` only as the guarded enum-member lookup older Pythons pickle)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        if (module, name) not in _ALLOWED:  # exact: "os.system" reached through an allowed module is not
            raise CheckpointFormatError(f"{METADATA} refers to a global DCP metadata never holds")
        obj = super().find_class(module, name)
        return obj

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointFormatError(f"{METADATA} holds a persistent reference")


def _plain(name: object) -> bool:
    return (
        isinstance(name, str)
        and bool(name)
        and name not in (".", "..")
        and not any(c in name for c in "/\\\0")
    )


def _validate_info(idx: Any, info: Any, where: str) -> None:
    """A storage entry must name a plain file and sane ranges, whatever the pickle constructed."""
    if isinstance(info, (DsioStorageInfo, _StorageInfo)):
        off, n = info.offset, info.length
        ok = _plain(info.relative_path) and type(off) is int and type(n) is int and off >= 0 and n >= 0
        if isinstance(info, DsioStorageInfo):
            ok = ok and type(info.crc32c) is int
            if info.dtype is not None:
                shape = info.shape
                ok = ok and info.dtype in DTYPES and isinstance(shape, tuple)
                ok = ok and all(type(d) is int and 0 <= d < 1 << 62 for d in shape)  # type: ignore[union-attr]
        else:
            crc = recorded_crc32c(info)
            ok = ok and (crc is None or type(crc) is int) and not info.transform_descriptors
        if ok:
            return
        raise CheckpointFormatError(f"{where}: malformed storage entry (or stream transforms, not supported)")
    raise CheckpointFormatError(f"{where}: storage entry of an unknown kind ({type(info).__name__})")


class DsioStorageReader(StorageReader):
    """DCP ``StorageReader`` for checkpoints of ``DsioStorageWriter`` or stock ``FileSystemWriter``;
    verifies crc32c where recorded."""

    def __init__(
        self, path: str | os.PathLike[str], *, config: IOConfig | None = None, verify: bool = True
    ) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.config = config or DEFAULT_IO
        self.verify = verify
        self.storage_data: dict[MetadataIndex, Any] = {}
        self.load_id = uuid.uuid4().hex

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.storage_data = {}
        if checkpoint_id:
            self.path = os.fspath(checkpoint_id)
        self.load_id = uuid.uuid4().hex

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = os.path.join(self.path, METADATA)
        fd = _fs.open_regular(path, what=path)
        with _fs.fd_closing(fd):
            raw = _fs.read_bounded(fd, MAX_METADATA_BYTES, path)
        try:
            md = _MetadataUnpickler(io.BytesIO(raw)).load()
        except CheckpointFormatError:
            raise
        except Exception as e:
            raise CheckpointFormatError(f"{path}: not valid DCP metadata ({type(e).__name__})") from None
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
            _validate_info(idx, info, f"{self.path}/{METADATA}")
        self.storage_data = data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        run_sync(self._read(plan, planner))
        return _done(None)

    async def _read(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        async with AsyncIOHandle(self.config) as h:
            files: dict[str, Any] = {}
            try:
                root_fd = _fs.open_dir(self.path, what=self.path, follow=True)
                try:
                    for req in plan.items:
                        rel = self.storage_data[req.storage_index].relative_path
                        if rel not in files:
                            p = os.path.join(self.path, rel)
                            fd = _fs.open_regular(rel, dir_fd=root_fd, what=p)
                            try:
                                files[rel] = (h.open(f"/proc/self/fd/{fd}", "r"), p)
                            finally:
                                os.close(fd)
                finally:
                    os.close(root_fd)

                async def one(req: ReadItem) -> None:
                    info = self.storage_data[req.storage_index]
                    f, path = files[info.relative_path]
                    if info.offset + info.length > f.size:
                        raise CheckpointFormatError(
                            f"{path}: item {req.storage_index.fqn!r} lies past the end of the file"
                        )
                    raw = placed(info.length, info.offset)
                    if info.length:
                        await f.pread(raw, info.offset)
                    crc = recorded_crc32c(info)
                    if self.verify and crc is not None and crc_of(raw.data_ptr(), info.length) != crc:
                        raise ChecksumError(
                            f"item {req.storage_index.fqn!r} in {path}: crc32c mismatch (corrupted file)"
                        )
                    if req.type == LoadItemType.BYTE_IO:
                        planner.load_bytes(req, io.BytesIO(raw.numpy().tobytes()))
                        return
                    saved = _decode(info, raw, path, req)
                    src = narrow_tensor_by_index(saved, req.storage_offsets, req.lengths)
                    target = planner.resolve_tensor(req).detach()
                    if target.size() != src.size():
                        raise CheckpointFormatError(
                            f"item {req.storage_index.fqn!r}: stored {tuple(src.size())}, "
                            f"expected {tuple(target.size())}"
                        )
                    target.copy_(src)
                    planner.commit_tensor(req, target)

                await wait_all([one(r) for r in plan.items], drain=True)
            finally:
                for f, _ in files.values():
                    f.close()

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


def _decode(info: Any, raw: torch.Tensor, path: str, req: ReadItem) -> torch.Tensor:
    """The tensor an item's bytes hold: raw bytes (DsioStorageInfo) or a torch.save record."""
    if isinstance(info, DsioStorageInfo):
        if info.dtype is None or info.shape is None:
            raise CheckpointFormatError(f"{path}: item {req.storage_index.fqn!r} has no dtype/shape")
        dtype = DTYPES[info.dtype]
        numel = 1
        for d in info.shape:
            numel *= d
        if numel * torch.empty(0, dtype=dtype).element_size() != info.length:
            raise CheckpointFormatError(
                f"{path}: item {req.storage_index.fqn!r}: dtype and shape do not fit its bytes"
            )
        if raw.data_ptr() % torch.empty(0, dtype=dtype).element_size():
            raw = raw.clone()
        return raw.view(dtype).view(info.shape)
    try:
        t = torch.load(io.BytesIO(raw.numpy().tobytes()), map_location="cpu", weights_only=True)
    except Exception as e:  # weights_only refuses anything but tensors and plain containers
        raise CheckpointFormatError(
            f"{path}: item {req.storage_index.fqn!r} is not a torch.save tensor record ({type(e).__name__})"
        ) from None
    if not isinstance(t, torch.Tensor):
        raise CheckpointFormatError(f"{path}: item {req.storage_index.fqn!r} does not hold a tensor")
    return t
