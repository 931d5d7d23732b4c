"""Checksums: crc32c per tensor (data) and one over the header (structure, names, shapes).

crc32c (the ``crc32c`` package, SSE4.2/ARMv8 hardware instructions, releases the GIL) runs at
8-12 GB/s on this machine, several times the disk, so it is computed on a worker thread while
the disk is busy and costs little wall time. Checksums are stored as fixed-width hex strings in
``__metadata__``, so the header length is known before the data has been checksummed.
"""

from __future__ import annotations

import ctypes
import json
import mmap
from typing import Any

import crc32c

from ..errors import CheckpointFormatError

__all__ = [
    "ALGORITHM",
    "CHECKSUMS_KEY",
    "FORMAT_KEY",
    "HEADER_CRC_KEY",
    "STATE_KEY",
    "crc_extend",
    "crc_of",
    "dump_header_json",
    "header_crc",
    "parse_checksums",
]

ALGORITHM = "crc32c"
FORMAT_KEY = "dsio.format"
STATE_KEY = "dsio.state"
CHECKSUMS_KEY = "dsio.crc32c"
HEADER_CRC_KEY = "dsio.header_crc32c"


def crc_of(ptr: int, nbytes: int) -> int:
    """crc32c of ``nbytes`` of memory at ``ptr`` (no copy; the GIL is released for large spans)."""
    if nbytes == 0:
        return 0
    view = memoryview((ctypes.c_char * nbytes).from_address(ptr)).cast("B")
    return int(crc32c.crc32c(view))


def hex32(v: int) -> str:
    return f"{v & 0xFFFFFFFF:08x}"


def dump_header_json(obj: dict[str, Any]) -> str:
    """The one JSON spelling of a header object that checksums are computed over."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def header_crc(obj: dict[str, Any]) -> str:
    """crc32c of the header object without its own ``HEADER_CRC_KEY``."""
    return hex32(crc32c.crc32c(dump_header_json(obj).encode()))


def parse_checksums(meta: dict[str, str], names: list[str], path: str) -> dict[str, int] | None:
    """The per-tensor checksums recorded in ``meta``; None for files without them (stock safetensors)."""
    raw = meta.get(CHECKSUMS_KEY)
    if raw is None:
        return None
    try:
        sums = json.loads(raw)
        out = {n: int(sums[n], 16) for n in names}
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointFormatError(f"{path}: checksum table is malformed or incomplete ({e!r})") from None
    return out


_ZEROS: mmap.mmap | None = None  # read-only anonymous zero pages: no memory until (never) written


def _zeros(n: int) -> memoryview:
    global _ZEROS
    if _ZEROS is None or len(_ZEROS) < n:
        _ZEROS = mmap.mmap(-1, max(n, 1 << 20), prot=mmap.PROT_READ)
    return memoryview(_ZEROS)[:n]


def crc_extend(crc: int, piece_crc: int, piece_len: int) -> int:
    """crc32c of ``A + B`` from ``crc`` = crc32c(A) and ``piece_crc`` = crc32c(B), ``piece_len`` = len(B).

    crc32c(B, start) is affine in ``start`` with a linear part that depends on len(B) only, so
    crc32c(B, a) = crc32c(0^n, a) ^ crc32c(0^n, 0) ^ crc32c(B, 0): two passes over zero pages (a
    streamed save fills its windows out of file order and joins each tensor's pieces with this)."""
    if piece_len == 0:
        return crc
    z = _zeros(piece_len)
    return int(crc32c.crc32c(z, crc)) ^ int(crc32c.crc32c(z, 0)) ^ piece_crc
