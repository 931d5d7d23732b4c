"""Checksums: crc32c per tensor (data) and one over the header (structure, names, shapes).

crc32c (the ``crc32c`` package, SSE4.2/ARMv8 hardware instructions, releases the GIL) runs at
8-12 GB/s on this machine, several times the disk, so it is computed on a worker thread while
the disk is busy and costs little wall time. Checksums are stored as fixed-width hex strings in
``__metadata__``, so the header length is known before the data has been checksummed.
"""

from __future__ import annotations

import ctypes
import json
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


_POLY = 0x82F63B78  # crc32c (Castagnoli), reflected


def _gf2_times(mat: list[int], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _gf2_square(mat: list[int]) -> list[int]:
    return [_gf2_times(mat, mat[n]) for n in range(32)]


def _zeros_operators() -> list[list[int]]:
    """``ops[k]``: the 32x32 GF(2) matrix that advances a crc32c register over 2**k zero bytes."""
    one_bit = [_POLY] + [1 << n for n in range(31)]  # one zero bit
    m = _gf2_square(_gf2_square(_gf2_square(one_bit)))  # one zero byte
    ops = [m]
    for _ in range(63):
        m = _gf2_square(m)
        ops.append(m)
    return ops


_OPS: list[list[int]] | None = None


def crc_extend(crc: int, piece_crc: int, piece_len: int) -> int:
    """crc32c of ``A + B`` from ``crc`` = crc32c(A) and ``piece_crc`` = crc32c(B), ``piece_len`` = len(B).

    crc32c(B, a) = Z(a) ^ crc32c(B, 0), where Z advances the register over len(B) zero bytes: a
    linear map, applied as the product of the precomputed matrices for the set bits of len(B)
    (zlib's crc32_combine). Microseconds whatever the length, so pieces checksummed on different
    threads, or out of file order, are joined for free."""
    global _OPS
    if piece_len == 0:
        return crc
    if _OPS is None:
        _OPS = _zeros_operators()
    reg, k, n = crc & 0xFFFFFFFF, 0, piece_len
    while n:
        if n & 1:
            reg = _gf2_times(_OPS[k], reg)
        n >>= 1
        k += 1
    return reg ^ piece_crc
