"""Checksums: crc32c per tensor (data), per block of a big tensor, and one over the header (structure).

A tensor larger than `BLOCK_BYTES` also records the crc32c of each `BLOCK_BYTES` block of its
bytes (counted from its first byte; the last block may be short) under `BLOCKS_KEY`, so that a
read of a part of it (a rank resharding another rank's file reads only its slice) is checked
before its bytes are used: the reader rounds the range out to whole blocks and checks each.
A tensor of at most one block needs none: its whole-tensor crc32c is its one block's. The
writer computes the blocks' sums on its copier threads (`piece_sums`) and derives the tensor's
crc32c from them (`TensorSums`), so the bytes are checksummed once.

crc32c of memory (`crc_of`, `crc_continue`) runs on one of two paths, chosen once per process:
``avx512`` (dsio's native core, ``csrc/crc32c.cpp``: 4 x 512-bit VPCLMULQDQ folds, where the CPU
has avx512f/bw/vl + vpclmulqdq) or ``portable`` (the ``crc32c`` package: the SSE4.2/ARMv8 crc32
instruction, ~14 GB/s per core here; any CPU, and where the native core is not built). Both give
the same values, release the GIL for large spans, and run on the copier threads while the disk is
busy. ``DSIO_CRC32C=portable`` forces the package (``auto``, the default, picks ``avx512`` where it
runs); `crc_path` says which one this process uses. A fresh load's checksums are the engine
copier's (`dsio._sums`: the native AVX-512 folds, else the SSE4.2 instruction, whatever this
variable says; ``SWITCHES.engine_sums=False`` hands them back to `crc_of`). Checksums are stored as fixed-width hex strings
in ``__metadata__``, so the header length is known before the data has been checksummed.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import crc32c

from .._memory import memcpy
from .._native import available, native
from ..errors import CheckpointFormatError, ConfigError

__all__ = [
    "ALGORITHM",
    "BLOCKS_KEY",
    "BLOCK_BYTES",
    "BLOCK_BYTES_KEY",
    "CHECKSUMS_KEY",
    "FORMAT_KEY",
    "HEADER_CRC_KEY",
    "CRC32C_ENV",
    "STATE_KEY",
    "copy_crc",
    "crc_continue",
    "crc_extend",
    "crc_of",
    "crc_path",
    "crc_paths",
    "dump_header_json",
    "header_crc",
    "TensorSums",
    "parse_blocks",
    "parse_checksums",
    "piece_sums",
]

ALGORITHM = "crc32c"
FORMAT_KEY = "dsio.format"
STATE_KEY = "dsio.state"
CHECKSUMS_KEY = "dsio.crc32c"
HEADER_CRC_KEY = "dsio.header_crc32c"
BLOCKS_KEY = "dsio.crc32c_blocks"
BLOCK_BYTES_KEY = "dsio.crc32c_block_bytes"
#: Bytes per checksummed block of a big tensor (a partial read is rounded out to these).
BLOCK_BYTES = 1 << 20


#: The environment variable that picks the crc32c path: ``auto`` (default) or ``portable``.
CRC32C_ENV = "DSIO_CRC32C"
_MODES = ("auto", "portable")
CrcFn = Callable[[int, int, int], int]
"""``(ptr, nbytes, value) -> crc32c`` of ``nbytes`` at ``ptr`` continuing ``value``."""

log = logging.getLogger("dsio")


def _crc_portable(ptr: int, nbytes: int, value: int) -> int:
    if nbytes == 0:
        return value
    view = memoryview((ctypes.c_char * nbytes).from_address(ptr)).cast("B")
    return int(crc32c.crc32c(view, value))


def crc_paths() -> dict[str, CrcFn]:
    """The crc32c paths this machine runs, by name: ``portable`` always, ``avx512`` where the native
    core is built and the CPU has AVX-512 + VPCLMULQDQ, ``sse42`` where it is built and the CPU has
    the SSE4.2 crc32 instruction (the engine copier's kernel where AVX-512 is missing: `dsio._sums`;
    never chosen for `crc_of`, the package runs the same instruction). Each ``(ptr, nbytes, value)
    -> crc32c``."""
    out: dict[str, CrcFn] = {"portable": _crc_portable}
    if available() and native().crc32c_avx512_supported():
        out["avx512"] = native().crc32c_avx512
    if available() and native().crc32c_sse42_supported():
        out["sse42"] = native().crc32c_sse42
    return out


CopyCrcFn = Callable[[int, int, int], int]
"""``(dst, src, nbytes) -> crc32c``: copy ``nbytes`` from ``src`` to ``dst`` and checksum them."""


def _copy_then_crc(crc: CrcFn) -> CopyCrcFn:
    def copy_crc(dst: int, src: int, nbytes: int) -> int:
        memcpy(dst, src, nbytes)
        return crc(dst, nbytes, 0)  # right after the copy: the bytes are in this core's cache

    return copy_crc


def _copy_crc_fused(dst: int, src: int, nbytes: int) -> int:
    return int(native().copy_crc32c(dst, src, nbytes, 0))


_chosen: tuple[str, CrcFn, CopyCrcFn] | None = None
_choose_lock = threading.Lock()


def _choose() -> tuple[str, CrcFn, CopyCrcFn]:
    global _chosen
    with _choose_lock:
        if _chosen is None:
            mode = os.environ.get(CRC32C_ENV) or "auto"
            if mode not in _MODES:
                raise ConfigError(
                    f"{CRC32C_ENV}={mode!r}: accepted values are {', '.join(_MODES)}", field=CRC32C_ENV
                )
            paths = crc_paths()
            if mode == "portable":
                why = f"{CRC32C_ENV}=portable"
            elif "avx512" in paths:
                why = ""
            elif not available():
                why = "dsio's native core is not built"
            else:
                why = "this CPU lacks avx512f/bw/vl + vpclmulqdq"
            name = "portable" if why else "avx512"
            if why:
                log.info("dsio: crc32c on the crc32c package's path (%s)", why)
            # avx512: the native core's copy fused with the same folds (`copy_crc`)
            _chosen = (
                name,
                paths[name],
                _copy_crc_fused if name == "avx512" else _copy_then_crc(paths[name]),
            )
        return _chosen


def crc_path() -> str:
    """The crc32c path this process uses (``avx512`` or ``portable``), chosen on first use."""
    return (_chosen or _choose())[0]


def crc_continue(ptr: int, nbytes: int, value: int) -> int:
    """crc32c of ``nbytes`` of memory at ``ptr`` continuing ``value`` (a previous result; 0 to
    start), as ``crc32c.crc32c(data, value)``: no copy, the GIL released for large spans."""
    return (_chosen or _choose())[1](ptr, nbytes, value)


def crc_of(ptr: int, nbytes: int) -> int:
    """crc32c of ``nbytes`` of memory at ``ptr`` (no copy; the GIL is released for large spans)."""
    return (_chosen or _choose())[1](ptr, nbytes, 0)


def copy_crc(dst: int, src: int, nbytes: int) -> int:
    """Copy ``nbytes`` from address ``src`` to ``dst`` and return their crc32c (GIL released). On the
    ``avx512`` path one native pass (``csrc/copy.cpp`` copy_crc32c: each 64 KiB step checksummed,
    then copied from the cache with streaming stores): 11.4-11.8 vs 8.2-8.6 GB/s per CPU second for
    memcpy then crc32c of 1 MiB blocks (256 MiB, best of 3, 4 rounds, under load 9.7). Elsewhere
    memcpy, then the path's crc32c while the bytes are in the cache."""
    return (_chosen or _choose())[2](dst, src, nbytes)


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


def parse_blocks(
    meta: dict[str, str], sizes: dict[str, int], sums: dict[str, int] | None, path: str
) -> tuple[int, dict[str, list[int]]]:
    """(block bytes, per tensor its blocks' crc32c) where the file records them (``sizes``: each
    tensor's bytes; ``sums``: `parse_checksums`). A tensor of at most one block gets its whole
    crc32c as its one block's (any dsio file); a bigger one only where `BLOCKS_KEY` lists it."""
    if sums is None:
        return BLOCK_BYTES, {}
    raw, size_raw = meta.get(BLOCKS_KEY), meta.get(BLOCK_BYTES_KEY)
    try:
        block = BLOCK_BYTES if size_raw is None else int(size_raw)
        if block <= 0:
            raise ValueError(block)
        listed = {} if raw is None else json.loads(raw)
        if not isinstance(listed, dict):
            raise TypeError(type(listed).__name__)
        out: dict[str, list[int]] = {}
        for name, n in sizes.items():
            if n <= block:
                out[name] = [sums[name]]
            elif name in listed:
                hexes = listed[name]
                count = -(-n // block)
                if not isinstance(hexes, str) or len(hexes) != 8 * count:
                    raise ValueError(f"{name!r} lists {len(hexes) // 8} blocks, not {count}")
                out[name] = [int(hexes[8 * i : 8 * i + 8], 16) for i in range(count)]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointFormatError(f"{path}: block checksum table is malformed ({e!r})") from None
    return block, out


def piece_sums(ptr: int, offset: int, nbytes: int, block: int = BLOCK_BYTES) -> list[tuple[int, int, int]]:
    """``(offset, crc32c, bytes)`` of ``nbytes`` at ``ptr`` -- bytes ``[offset, offset + nbytes)`` of a
    tensor -- cut at the tensor's block bounds (run on a copier thread, right after the copy)."""
    out = []
    pos, end = offset, offset + nbytes
    while pos < end:
        k = min(end, (pos // block + 1) * block) - pos
        out.append((pos, crc_of(ptr + pos - offset, k), k))
        pos += k
    return out


class TensorSums:
    """One tensor's crc32c and its blocks' (`BLOCK_BYTES`), from `piece_sums` given in any order."""

    def __init__(self, nbytes: int, block: int = BLOCK_BYTES) -> None:
        self.nbytes = nbytes
        self.block = block
        self._pieces: list[tuple[int, int, int]] = []

    def add(self, pieces: list[tuple[int, int, int]]) -> None:
        self._pieces.extend(pieces)

    def finish(self) -> tuple[int, list[int]]:
        """(the tensor's crc32c, its blocks' crc32c); RuntimeError unless the pieces tile the tensor
        exactly (a writer's bug, never user input)."""
        blocks: list[int] = []
        whole, pos, cur, cur_len = 0, 0, 0, 0
        for off, crc, n in sorted(self._pieces):
            if off != pos or (off // self.block) != ((off + n - 1) // self.block):
                raise RuntimeError(f"checksummed pieces do not tile the tensor at byte {pos} (got {off})")
            cur = crc_extend(cur, crc, n)
            cur_len += n
            pos += n
            if pos % self.block == 0 or pos == self.nbytes:
                blocks.append(cur)
                whole = crc_extend(whole, cur, cur_len)
                cur, cur_len = 0, 0
        if pos != self.nbytes:
            raise RuntimeError(f"checksummed pieces cover {pos} of {self.nbytes} bytes")
        return whole, blocks

    def blocks_hex(self, blocks: list[int]) -> str | None:
        """The `BLOCKS_KEY` entry of this tensor (None for one of at most one block)."""
        return None if self.nbytes <= self.block else "".join(hex32(b) for b in blocks)


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
#: Byte tables of the zero-advance operator of the lengths joined over and over (a big tensor's
#: 1 MiB blocks): 4 lookups per join instead of a GF(2) matrix-vector product in Python.
_TABLES: dict[int, tuple[list[int], list[int], list[int], list[int]]] = {}


def _advance(reg: int, length: int) -> int:
    """The crc32c register ``reg`` advanced over ``length`` zero bytes (matrix products)."""
    global _OPS
    if _OPS is None:
        _OPS = _zeros_operators()
    k, n = 0, length
    while n and reg:
        if n & 1:
            reg = _gf2_times(_OPS[k], reg)
        n >>= 1
        k += 1
    return reg


def _tables(length: int) -> tuple[list[int], list[int], list[int], list[int]]:
    """`_advance` over ``length`` bytes as 4 tables of 256 (one per byte of the register): the
    operator is linear, so a register's image is the XOR of its bytes' images."""
    cols = [_advance(1 << i, length) for i in range(32)]
    out = []
    for j in range(4):
        t = [0] * 256
        for v in range(1, 256):
            low = v & -v
            t[v] = t[v ^ low] ^ cols[8 * j + low.bit_length() - 1]
        out.append(t)
    return out[0], out[1], out[2], out[3]


def crc_extend(crc: int, piece_crc: int, piece_len: int) -> int:
    """crc32c of ``A + B`` from ``crc`` = crc32c(A) and ``piece_crc`` = crc32c(B), ``piece_len`` = len(B).

    crc32c(B, a) = Z(a) ^ crc32c(B, 0), where Z advances the register over len(B) zero bytes: a
    linear map, applied as the product of the precomputed matrices for the set bits of len(B)
    (zlib's crc32_combine), or, for `BLOCK_BYTES` (joined once per block of every big tensor on the
    save's critical path: 60 ms per 1.4 GB in matrix products), as 4 table lookups. So pieces
    checksummed on different threads, or out of file order, are joined for (nearly) free."""
    reg = crc & 0xFFFFFFFF
    if piece_len == 0:
        return crc
    if reg == 0:  # the register of an empty prefix: nothing to advance
        return piece_crc
    tables = _TABLES.get(piece_len)
    if tables is None and piece_len == BLOCK_BYTES:
        tables = _TABLES[piece_len] = _tables(piece_len)
    if tables is not None:
        t0, t1, t2, t3 = tables
        reg = t0[reg & 0xFF] ^ t1[(reg >> 8) & 0xFF] ^ t2[(reg >> 16) & 0xFF] ^ t3[reg >> 24]
        return reg ^ piece_crc
    if available():  # any other length: the native core's combine (~1 us vs ~50 us here)
        return int(native().crc32c_combine(reg, piece_crc & 0xFFFFFFFF, piece_len))
    return _advance(reg, piece_len) ^ piece_crc
