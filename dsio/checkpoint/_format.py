"""The safetensors file layout, with the data section starting on a 4096-byte boundary.

A safetensors file is ``u64 little-endian N`` + ``N`` bytes of JSON header + the data section.
The JSON maps each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets
relative to the data section) plus an optional ``"__metadata__"`` map of str -> str. The reader
rejects gaps between tensors and bytes after the last one, so tensors are packed back to back and
the file length is exact. The header may end with trailing spaces: dsio pads it so that
``8 + N`` is a multiple of 4096, so the data section can be written and read with O_DIRECT
straight from/to page-aligned memory.

Tensors are laid out largest element size first (as safetensors does), so every tensor's offset
in the data section is a multiple of its element size and can be viewed in place.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..config import ALIGNMENT
from ..errors import CheckpointFormatError, ChecksumError
from ._integrity import FORMAT_KEY, HEADER_CRC_KEY, dump_header_json, header_crc

__all__ = [
    "DTYPES",
    "MAX_HEADER_BYTES",
    "Header",
    "TensorEntry",
    "dtype_name",
    "encode_header",
    "layout",
    "parse_header",
    "parse_header_length",
]

#: The safetensors reader refuses headers larger than this.
MAX_HEADER_BYTES = 100_000_000

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "C64": torch.complex64,
}
for _name, _attr in (
    ("U64", "uint64"),
    ("U32", "uint32"),
    ("U16", "uint16"),
    ("F8_E4M3", "float8_e4m3fn"),
    ("F8_E4M3FNUZ", "float8_e4m3fnuz"),
    ("F8_E5M2", "float8_e5m2"),
    ("F8_E5M2FNUZ", "float8_e5m2fnuz"),
):
    if hasattr(torch, _attr):
        DTYPES[_name] = getattr(torch, _attr)
_NAMES = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str | None:
    """The safetensors name of ``dtype``, or None when safetensors cannot hold it."""
    return _NAMES.get(dtype)


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of a file: ``[begin, end)`` are byte offsets within the data section."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True, slots=True)
class Header:
    """A parsed file: entries in file order, ``__metadata__`` and where the data section starts."""

    entries: tuple[TensorEntry, ...]
    metadata: dict[str, str]
    data_start: int

    @property
    def data_bytes(self) -> int:
        return self.entries[-1].end if self.entries else 0


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def layout(items: Iterable[tuple[str, torch.dtype, tuple[int, ...]]]) -> list[TensorEntry]:
    """Place tensors back to back, largest element size first (stable within a size)."""
    ordered = sorted(items, key=lambda it: -torch.empty(0, dtype=it[1]).element_size())
    out = []
    pos = 0
    for name, dtype, shape in ordered:
        n = _numel(shape) * torch.empty(0, dtype=dtype).element_size()
        out.append(TensorEntry(name, dtype, tuple(shape), pos, pos + n))
        pos += n
    return out


def encode_header(entries: Iterable[TensorEntry], metadata: Mapping[str, str], *, seal: bool = True) -> bytes:
    """``u64 N`` + the JSON header padded with spaces so that the result is a multiple of 4096.

    ``seal`` adds a crc32c of the whole header (names, shapes, offsets, metadata) as the last
    ``__metadata__`` entry, so that a flipped byte in the structure is caught like one in the data.
    """
    obj: dict[str, Any] = {}
    meta = dict(metadata)
    if meta or seal:
        obj["__metadata__"] = meta
    for e in entries:
        name = dtype_name(e.dtype)
        if name is None:  # pragma: no cover - callers check first
            raise CheckpointFormatError(f"dtype {e.dtype} has no safetensors name")
        obj[e.name] = {"dtype": name, "shape": list(e.shape), "data_offsets": [e.begin, e.end]}
    if seal:
        meta[HEADER_CRC_KEY] = header_crc(obj)
    body = dump_header_json(obj).encode()
    total = -(-(8 + len(body)) // ALIGNMENT) * ALIGNMENT
    n = total - 8
    if n > MAX_HEADER_BYTES:
        raise CheckpointFormatError(f"header of {n} bytes exceeds the safetensors limit {MAX_HEADER_BYTES}")
    return struct.pack("<Q", n) + body + b" " * (n - len(body))


def parse_header_length(prefix: bytes, file_size: int, path: str, limit: int = MAX_HEADER_BYTES) -> int:
    """N from the first 8 bytes, checked against the file size and ``limit`` (at most the
    safetensors limit), before anything of that size is allocated."""
    if file_size < 8 or len(prefix) < 8:
        raise CheckpointFormatError(f"{path}: {file_size} bytes is too short for a safetensors file")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > min(limit, MAX_HEADER_BYTES):
        raise CheckpointFormatError(
            f"{path}: header length {n} is over the limit of {min(limit, MAX_HEADER_BYTES)} bytes"
        )
    if 8 + n > file_size:
        raise CheckpointFormatError(
            f"{path}: header length {n} does not fit the file ({file_size} bytes): truncated or not safetensors"
        )
    return int(n)


#: Dimensions and offsets must fit torch's int64 sizes.
_INT_LIMIT = 1 << 63
#: More dimensions than any tensor has (torch allows 64 at most).
_MAX_DIMS = 64


def _int_list(v: object, what: str, path: str) -> list[int]:
    if (
        not isinstance(v, list)
        or len(v) > _MAX_DIMS
        or not all(type(x) is int and 0 <= x < _INT_LIMIT for x in v)
    ):
        raise CheckpointFormatError(
            f"{path}: {what} must be a list of at most {_MAX_DIMS} non-negative int64s"
        )
    return v


def _storage_bytes(shape: list[int], esize: int, name: str, path: str) -> int:
    """Bytes of a tensor of ``shape``; a shape whose non-zero dims overflow int64 is refused
    (torch would refuse to allocate it even when another dim is 0)."""
    n = esize
    for d in shape:
        n *= max(d, 1)
        if n >= _INT_LIMIT:
            raise CheckpointFormatError(f"{path}: tensor {name!r} has a shape whose size overflows int64")
    return 0 if any(d == 0 for d in shape) else n


def parse_header(raw: bytes, file_size: int, path: str) -> Header:
    """Validate the JSON header ``raw`` (without the 8-byte length) of a file of ``file_size`` bytes.

    Raises ``CheckpointFormatError`` for anything the safetensors reader would also refuse, and
    for a data section that does not end exactly at the end of the file (truncation).
    """
    try:
        return _parse_header(raw, file_size, path)
    except RecursionError:  # JSON nested deeper than the interpreter's stack
        raise CheckpointFormatError(f"{path}: header JSON is nested too deeply") from None


def _parse_header(raw: bytes, file_size: int, path: str) -> Header:
    data_start = 8 + len(raw)
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointFormatError(f"{path}: header is not valid JSON ({err.__class__.__name__})") from None
    if not isinstance(obj, dict):
        raise CheckpointFormatError(f"{path}: header is not a JSON object")
    meta_raw = obj.get("__metadata__") or {}
    if not isinstance(meta_raw, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta_raw.items()
    ):
        raise CheckpointFormatError(f"{path}: __metadata__ must map strings to strings")
    sealed = meta_raw.pop(HEADER_CRC_KEY, None)
    if sealed is None and FORMAT_KEY in meta_raw:
        raise ChecksumError(f"{path}: header checksum missing from a dsio file (header corrupted)")
    if sealed is not None and sealed != header_crc(obj):
        raise ChecksumError(f"{path}: header checksum mismatch (names, shapes or metadata corrupted)")
    obj.pop("__metadata__", None)
    entries = []
    for name, info in obj.items():
        if not isinstance(info, dict):
            raise CheckpointFormatError(f"{path}: entry {name!r} is not an object")
        dt = info.get("dtype")
        dtype = DTYPES.get(dt) if isinstance(dt, str) else None
        if dtype is None:
            raise CheckpointFormatError(f"{path}: tensor {name!r} has an unknown or malformed dtype")
        shape = _int_list(info.get("shape"), f"shape of {name!r}", path)
        offs = _int_list(info.get("data_offsets"), f"data_offsets of {name!r}", path)
        if len(offs) != 2 or offs[0] > offs[1]:
            raise CheckpointFormatError(f"{path}: tensor {name!r} has invalid data_offsets {offs}")
        expect = _storage_bytes(shape, torch.empty(0, dtype=dtype).element_size(), name, path)
        if offs[1] - offs[0] != expect:
            raise CheckpointFormatError(
                f"{path}: tensor {name!r} spans {offs[1] - offs[0]} bytes but its dtype and shape need {expect}"
            )
        entries.append(TensorEntry(name, dtype, tuple(shape), offs[0], offs[1]))
    entries.sort(key=lambda e: (e.begin, e.end))
    pos = 0
    for e in entries:
        if e.begin != pos:
            raise CheckpointFormatError(
                f"{path}: tensor {e.name!r} starts at {e.begin}, expected {pos} (overlap or gap)"
            )
        pos = e.end
    if data_start + pos != file_size:
        raise CheckpointFormatError(
            f"{path}: header describes {data_start + pos} bytes but the file has {file_size} "
            f"({'truncated' if file_size < data_start + pos else 'trailing bytes'})"
        )
    return Header(tuple(entries), dict(meta_raw), data_start)
