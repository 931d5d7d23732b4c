"""A fresh load's checksums computed by the engine as each piece lands (`dsio._sums`), the default path.

Each span is one request; its crc32c are the engine copier's, fragment by fragment, joined per
tensor. Whatever the engine computes or leaves, a flipped byte anywhere in any tensor (at a tensor's
edges, at an engine piece's edge) is ``ChecksumError`` before the load returns; a file whose data
starts at an odd offset (a foreign writer's layout, with dsio's checksum table) loads exactly and
is checked the same way; a truncated file, before the load or while it reads, is a typed error.
Every test runs with the engine checksumming (``SWITCHES.engine_sums``) and with the reader doing it.
"""

from __future__ import annotations

import asyncio
import json
import os
import struct

import crc32c
import pytest
import torch
from ckpt_helpers import flip_byte

import dsio
import dsio.checkpoint as C
from dsio._sums import engine_sums
from dsio._tuning import SWITCHES
from dsio.checkpoint import _read
from dsio.checkpoint._integrity import CHECKSUMS_KEY

MiB = 1 << 20
ENGINE = pytest.mark.parametrize("engine", [True, False], ids=["engine_sums", "reader_sums"])


@pytest.fixture
def engine_switch(monkeypatch, engine):
    monkeypatch.setattr(SWITCHES, "engine_sums", engine)
    return engine


def run(coro):
    return asyncio.run(coro)


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {
        "a": torch.randn(7, generator=g),
        "big": torch.randn(900_001, generator=g),  # 3.6 MB: over several 1 MiB engine pieces
        "mid": torch.randn(300_003, generator=g),  # starts and ends mid-piece
        "half": torch.randn(33, generator=g).half(),
        "z": torch.randint(0, 256, (5,), dtype=torch.uint8, generator=g),
    }


def _header(path: str) -> tuple[int, dict]:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return 8 + n, json.loads(f.read(n))


async def _load_counting(path: str, **kw) -> tuple[dict, dsio.HandleStatistics]:
    async with dsio.AsyncIOHandle(C.DEFAULT_IO) as h:
        back = await C.load(path, handle=h, **kw)
        return back, h.statistics()


def _victims() -> list[str]:
    out = []
    for name in ("a", "big", "mid", "half", "z"):
        out += [f"{name}:first", f"{name}:last"]
    return out + ["big:middle", "piece_edge_before", "piece_edge_after"]


@ENGINE
@pytest.mark.parametrize("victim", _victims())
def test_a_flipped_byte_anywhere_in_any_tensor_is_caught(tmp_path, engine_switch, victim):
    state = _state()
    path = str(tmp_path / "s.safetensors")
    run(C.save(state, path))
    ds, header = _header(path)
    back, st = run(_load_counting(path))
    assert all(torch.equal(back[k], v) for k, v in state.items())
    data_bytes = os.path.getsize(path) - ds
    if engine_switch and engine_sums():  # the new path did the checksums: all but the tail page
        assert st.engine.checksummed_bytes >= data_bytes - 4096
    else:
        assert st.engine.checksummed_bytes == 0
    if victim.startswith("piece_edge"):  # the last byte of the engine's first piece, or the next one
        pos = ds + MiB - (1 if victim.endswith("before") else 0)
    else:
        name, where = victim.split(":")
        lo, hi = header[name]["data_offsets"]
        pos = ds + {"first": lo, "last": hi - 1, "middle": (lo + hi) // 2 + 3}[where]
    flip_byte(path, pos, 0x04)
    with pytest.raises(C.ChecksumError):
        run(C.load(path))
    run(C.load(path, verify=False))  # the caller's explicit choice: no check, no error


@ENGINE
def test_a_checkpointer_load_catches_a_flipped_byte_on_the_default_path(tmp_path, engine_switch):
    state = _state()

    async def main() -> None:
        async with C.Checkpointer(tmp_path) as ck:
            res = await (await ck.save(1, state))
            back = await ck.load()
            assert all(torch.equal(back[k], v) for k, v in state.items())
            path = os.path.join(res.path, "rank-00000.safetensors")
            ds, header = _header(path)
            flip_byte(path, ds + header["big"]["data_offsets"][0] + 2 * MiB + 17, 0x80)
            with pytest.raises(C.ChecksumError):
                await ck.load()

    run(main())


def _odd_checksummed_file(path: str) -> dict[str, torch.Tensor]:
    """A safetensors file whose data starts at an odd offset (every tensor misaligned for its dtype
    and for O_DIRECT), with dsio's per-tensor checksum table in its metadata."""
    g = torch.Generator().manual_seed(13)
    tensors = {
        "a_u8": torch.randint(0, 256, (3,), dtype=torch.uint8, generator=g),
        "b_f32": torch.randn(5000, generator=g),
        "c_big": torch.randn(700_001, generator=g),  # 2.8 MB over several engine pieces
        "d_f64": torch.randn(7, generator=g, dtype=torch.float64),
    }
    header: dict[str, object] = {}
    blobs, sums, pos = [], {}, 0
    for name, t in tensors.items():
        raw = t.contiguous().view(torch.uint8).numpy().tobytes()
        dt = {torch.uint8: "U8", torch.float32: "F32", torch.float64: "F64"}[t.dtype]
        header[name] = {"dtype": dt, "shape": list(t.shape), "data_offsets": [pos, pos + len(raw)]}
        sums[name] = f"{crc32c.crc32c(raw):08x}"
        blobs.append(raw)
        pos += len(raw)
    header["__metadata__"] = {CHECKSUMS_KEY: json.dumps(sums)}
    text = json.dumps(header).encode()
    if (8 + len(text)) % 2 == 0:
        text += b" "
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))
    return tensors


@ENGINE
@pytest.mark.parametrize("victim", [None, "a_u8", "b_f32", "c_big", "d_f64"])
def test_a_file_with_odd_data_offsets_loads_exactly_and_is_checked(tmp_path, engine_switch, victim):
    path = str(tmp_path / "odd.safetensors")
    tensors = _odd_checksummed_file(path)
    ds, header = _header(path)
    assert ds % 2 == 1
    if victim is None:
        back = run(C.load(path))
        for k, t in tensors.items():
            assert back[k].dtype == t.dtype and torch.equal(back[k], t), k
        return
    lo, hi = header[victim]["data_offsets"]
    flip_byte(path, ds + (lo + hi) // 2, 0x01)
    with pytest.raises(C.ChecksumError):
        run(C.load(path))


@ENGINE
@pytest.mark.parametrize("cut", ["header_only", "mid_first_piece", "piece_edge", "minus_1", "minus_page"])
def test_a_truncated_file_is_a_format_error(tmp_path, engine_switch, cut):
    path = str(tmp_path / "s.safetensors")
    run(C.save(_state(), path))
    ds, _ = _header(path)
    size = os.path.getsize(path)
    os.truncate(
        path,
        {
            "header_only": ds,
            "mid_first_piece": ds + MiB // 2 + 3,
            "piece_edge": ds + MiB,
            "minus_1": size - 1,
            "minus_page": size - 4096,
        }[cut],
    )
    with pytest.raises(dsio.errors.CheckpointFormatError):
        run(C.load(path))


@ENGINE
def test_a_file_truncated_while_it_is_read_is_a_short_read_error(tmp_path, engine_switch, monkeypatch):
    """The file shrinks after its header was checked (another process truncates it): the span's
    read comes back short, which is ``ShortIOError`` (an ``IOFailedError``), never tensors."""
    path = str(tmp_path / "s.safetensors")
    run(C.save(_state(), path))
    real = _read.read_header

    async def then_truncate(f, p, size, *a, **kw):
        header = await real(f, p, size, *a, **kw)
        os.truncate(path, size - 2 * MiB)
        return header

    monkeypatch.setattr(_read, "read_header", then_truncate)
    with pytest.raises(dsio.errors.ShortIOError):
        run(C.load(path))
