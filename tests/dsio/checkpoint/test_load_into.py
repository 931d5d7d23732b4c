"""``load(into=state)``: the file's tensors read into an existing state's tensors, in place.

What it must keep: the returned state holds the given tensor objects (no fresh memory) with the
file's bytes and the file's other values; a file cut into many bounce-buffer pieces, or whose
tensors sit at odd offsets, loads exactly; a flipped byte anywhere is ``ChecksumError``; a state
that does not match the file (names, dtypes, shapes, layout) is refused before any byte is read;
no descriptor is left open, after an error either.
"""

from __future__ import annotations

import asyncio
import json
import os
import struct

import pytest
import safetensors.torch as st
import torch
from ckpt_helpers import assert_same, flip_byte, make_state

import dsio.checkpoint as C
from dsio.checkpoint import _read
from dsio.checkpoint._state import flatten
from dsio.errors import CheckpointMismatchError, ChecksumError, TensorLayoutError


def run(coro):
    return asyncio.run(coro)


def _tensors(state) -> dict[str, torch.Tensor]:
    return {k: t for k, t in flatten(state, allow_pickle=True)[0].items() if isinstance(t, torch.Tensor)}


def _leaves(obj, where: str = "") -> dict[str, torch.Tensor]:
    """The torch tensors of a state by where they sit (numpy arrays, also stored, are not tensors)."""
    if isinstance(obj, torch.Tensor):
        return {where: obj}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    return {k: v for i, x in items for k, v in _leaves(x, f"{where}/{i}").items()}


def _scrambled(state):
    """The same structure as ``state`` with every tensor's bytes changed (fresh memory each)."""
    out = make_state(seed=0)  # same structure, its own tensors
    for t in _tensors(out).values():
        if t.numel():
            t.view(-1).view(torch.uint8).fill_(0xA5)
    return out


@pytest.fixture
def small_pieces(monkeypatch):
    """Bounce buffers of 64 KiB, 2 of them: every tensor over 64 KiB spans pieces, buffers recycle;
    each part is checksummed and copied in 4 KiB steps (a running crc32c over several steps)."""
    monkeypatch.setattr(_read, "INTO_PIECE_BYTES", 64 << 10)
    monkeypatch.setattr(_read, "INTO_BUFFERS", 2)
    monkeypatch.setattr(_read, "COPY_STEP_BYTES", 4096)


def _big_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "big": torch.randn(300_001, generator=g),  # 1.2 MB: ~19 pieces, blocks of 1 MiB
        "small": torch.randn(17, generator=g),
        "half": torch.randn(33, generator=g).half(),
        "bytes": torch.randint(0, 256, (5,), dtype=torch.uint8, generator=g),
        "empty": torch.zeros(3, 0),
        "last": torch.randn(70_000, generator=g, dtype=torch.float64),
    }


@pytest.mark.parametrize("pieces", ["default", "small"])
def test_checkpointer_load_into_fills_the_given_tensors_in_place(tmp_path, request, pieces):
    if pieces == "small":
        request.getfixturevalue("small_pieces")
    saved = make_state(seed=0)

    async def go():
        ck = C.Checkpointer(str(tmp_path / "ck"))
        try:
            await (await ck.save(3, saved))
            target = _scrambled(saved)
            before = {k: t.data_ptr() for k, t in _leaves(target).items()}
            back = await ck.load(3, into=target)
            return target, before, back
        finally:
            ck.close()

    target, before, back = run(go())
    assert_same(back, saved)  # the file's values, the file's structure (scalars from the file)
    got = _leaves(back)
    assert got.keys() == before.keys() and len(got) > 20
    for k, t in got.items():
        assert t.data_ptr() == before[k], k  # the state's own memory, filled in place
    assert_same(target["model"], saved["model"])  # ... so the given state holds the file's bytes
    sd = back["model"]
    assert sd["wte.weight"].data_ptr() == sd["head.weight"].data_ptr()  # tied weights stay tied


def test_one_shot_load_into_a_file_cut_in_many_pieces_is_exact(tmp_path, small_pieces):
    state = _big_state()
    path = str(tmp_path / "s.safetensors")
    run(C.save(state, path))
    target = {k: torch.full_like(t, 7) for k, t in state.items()}
    back = run(C.load(path, into=target))
    assert list(back) == list(state)
    for k, t in state.items():
        assert back[k] is not t and back[k].data_ptr() == target[k].data_ptr(), k
        assert torch.equal(back[k], t), k


def test_load_into_a_stock_safetensors_file_with_odd_offsets(tmp_path, small_pieces):
    g = torch.Generator().manual_seed(4)
    tensors = {
        "a_u8": torch.randint(0, 256, (3,), dtype=torch.uint8, generator=g),
        "b_f32": torch.randn(40_000, generator=g),
        "c_f64": torch.randn(7, generator=g, dtype=torch.float64),
    }
    header, blobs, pos = {}, [], 0
    for name, t in tensors.items():  # written by hand: b_f32 starts at data byte 3
        raw = t.view(torch.uint8).numpy().tobytes()
        dt = {torch.uint8: "U8", torch.float32: "F32", torch.float64: "F64"}[t.dtype]
        header[name] = {"dtype": dt, "shape": list(t.shape), "data_offsets": [pos, pos + len(raw)]}
        blobs.append(raw)
        pos += len(raw)
    text = json.dumps(header).encode()
    path = str(tmp_path / "foreign.safetensors")
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))
    assert all(torch.equal(st.load_file(path)[k], t) for k, t in tensors.items())  # a valid file
    target = {k: torch.zeros_like(t) for k, t in tensors.items()}
    back = run(C.load(path, into=target))
    for k, t in tensors.items():
        assert back[k].data_ptr() == target[k].data_ptr() and torch.equal(target[k], t), k


def _data_start(path: str) -> int:
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


@pytest.mark.parametrize("where", ["first", "piece_edge", "middle", "last"])
def test_a_flipped_byte_anywhere_is_a_checksum_error(tmp_path, small_pieces, where):
    state = _big_state()
    path = str(tmp_path / "s.safetensors")
    run(C.save(state, path))
    ds, size = _data_start(path), os.path.getsize(path)
    lo = ds & ~4095
    pos = {
        "first": ds,
        "piece_edge": lo + (64 << 10),  # the first byte of the second bounce-buffer piece
        "middle": (ds + size) // 2,
        "last": size - 1,
    }[where]
    flip_byte(path, pos)
    target = {k: torch.zeros_like(t) for k, t in state.items()}
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(ChecksumError):
        run(C.load(path, into=target))
    assert len(os.listdir("/proc/self/fd")) == fds  # no descriptor left open by the failed load
    back = run(C.load(path, into=target, verify=False))  # unverified: the corrupt bytes come back
    assert sum(not torch.equal(back[k], state[k]) for k in state) == 1


def test_a_state_that_does_not_match_the_file_is_refused_before_any_byte_is_read(tmp_path):
    state = _big_state()
    path = str(tmp_path / "s.safetensors")
    run(C.save(state, path))

    def target(**change):
        t = {k: torch.full_like(v, 9) for k, v in state.items()}
        t.update(change)
        return {k: v for k, v in t.items() if v is not None}

    cases = [
        (target(small=None), CheckpointMismatchError),  # a file tensor the state lacks
        (target(extra=torch.zeros(2)), CheckpointMismatchError),  # a state tensor the file lacks
        (target(small=torch.zeros(17, dtype=torch.float64)), CheckpointMismatchError),  # dtype
        (target(small=torch.zeros(18)), CheckpointMismatchError),  # shape
        (target(big=torch.zeros(300_001, 1)), CheckpointMismatchError),  # same bytes, other shape
        (target(last=torch.zeros(140_000, dtype=torch.float64)[::2]), TensorLayoutError),  # strided
    ]
    fds = len(os.listdir("/proc/self/fd"))
    for into, err in cases:
        snapshot = {k: v.clone() for k, v in into.items()}
        with pytest.raises(err):
            run(C.load(path, into=into))
        for k, v in into.items():  # nothing was read into any of them
            assert torch.equal(v, snapshot[k]), k
    assert len(os.listdir("/proc/self/fd")) == fds


def test_destinations_that_share_memory_are_refused_before_any_byte_is_read(tmp_path):
    # two names whose destinations overlap (views of one buffer): both copies land in the same bytes,
    # so one tensor would silently come back with the other's values (the checksums are of the file)
    state = {"a": torch.arange(8, dtype=torch.float32), "b": torch.full((4,), -1.0)}
    path = str(tmp_path / "s.safetensors")
    run(C.save(state, path))
    buf = torch.full((8,), 9.0)
    for into in ({"a": buf, "b": buf[:4]}, {"a": buf, "b": buf[4:]}, {"a": buf, "b": buf.view(2, 4)[1]}):
        with pytest.raises(TensorLayoutError):
            run(C.load(path, into=into))
        assert torch.equal(buf, torch.full((8,), 9.0))  # nothing was read into it
    apart = torch.zeros(12)  # views of one buffer that do not overlap are fine (a flat parameter buffer)
    back = run(C.load(path, into={"a": apart[:8], "b": apart[8:]}))
    assert torch.equal(back["a"], state["a"]) and torch.equal(back["b"], state["b"])


def test_a_destination_whose_bytes_are_not_its_values_is_refused(tmp_path):
    # a lazily conjugated or negated view is contiguous, but its memory holds the values before the
    # conjugation / negation: the file's bytes copied there would read back conjugated / negated
    state = {"c": torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64), "x": torch.tensor([1.0, -2.0])}
    path = str(tmp_path / "s.safetensors")
    run(C.save(state, path))
    for into in (
        {"c": torch.zeros(2, dtype=torch.complex64).conj(), "x": torch.zeros(2)},
        {"c": torch.zeros(2, dtype=torch.complex64), "x": torch.zeros(2)._neg_view()},
    ):
        with pytest.raises(TensorLayoutError):
            run(C.load(path, into=into))
    back = run(C.load(path, into={"c": torch.zeros(2, dtype=torch.complex64), "x": torch.zeros(2)}))
    assert torch.equal(back["c"], state["c"]) and torch.equal(back["x"], state["x"])


def test_into_is_not_combined_with_lazy_loads_or_another_device(tmp_path):
    state = _big_state()
    path = str(tmp_path / "s.safetensors")
    run(C.save(state, path))
    target = {k: torch.zeros_like(t) for k, t in state.items()}
    with pytest.raises(ValueError):
        run(C.load(path, into=target, device="meta"))

    async def lazy():
        ck = C.Checkpointer(str(tmp_path / "ck"))
        try:
            await (await ck.save(1, state))
            await ck.load(1, into=target, lazy_from=1 << 20)
        finally:
            ck.close()

    with pytest.raises(ValueError):
        run(lazy())
