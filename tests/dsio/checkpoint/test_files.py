"""One checkpoint file: safetensors layout, interop with stock safetensors, state round trips."""

from __future__ import annotations

import asyncio
import os
import random
import struct

import numpy as np
import pytest
import safetensors
import safetensors.torch as st
import torch
from ckpt_helpers import assert_same, make_state, make_training

import dsio
import dsio.checkpoint as C
from dsio.checkpoint._format import DTYPES


def run(coro):
    return asyncio.run(coro)


def _all_dtypes() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    out = {}
    for name, dt in DTYPES.items():
        raw = torch.randint(0, 256, (3 * 5 * dt.itemsize,), dtype=torch.uint8, generator=g)
        out[f"t_{name}"] = raw.view(dt).view(3, 5) if dt != torch.bool else (raw % 2).bool().view(3, 5)
    out["scalar"] = torch.tensor(2.5)
    out["empty"] = torch.zeros(4, 0)
    out["odd_u8"] = torch.arange(7, dtype=torch.uint8)  # 7 bytes: forces unaligned neighbours
    out["big"] = torch.randn(3 << 18, generator=g)  # 3 MiB: read straight into place
    return out


def test_file_is_stock_safetensors_with_aligned_data(tmp_path):
    tensors = _all_dtypes()
    path = str(tmp_path / "a.safetensors")
    size = run(C.save(tensors, path))
    assert os.path.getsize(path) == size
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    assert (8 + n) % 4096 == 0  # data section starts on a page boundary
    back = st.load_file(path)
    assert set(back) == set(tensors)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and torch.equal(
            back[k].view(torch.uint8) if v.dim() else back[k], v.view(torch.uint8) if v.dim() else v
        ), k
    with safetensors.safe_open(path, "pt") as f:
        meta = f.metadata()
    assert meta["dsio.format"] == "1" and "dsio.crc32c" in meta


def test_reads_stock_safetensors_files(tmp_path):
    tensors = _all_dtypes()
    path = str(tmp_path / "stock.safetensors")
    st.save_file(tensors, path, metadata={"who": "stock"})
    back = run(C.load(path))
    assert isinstance(back, dict) and set(back) == set(tensors)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape
        assert torch.equal(
            back[k].view(torch.uint8) if v.dim() else back[k], v.view(torch.uint8) if v.dim() else v
        ), k


def test_realistic_state_round_trip(tmp_path):
    state = make_state(seed=3)
    path = str(tmp_path / "state.safetensors")
    run(C.save(state, path))
    back = run(C.load(path))
    assert_same(state, back)
    # The loaded state really restores training: same next loss as the original objects.
    model, opt, sched = make_training(3)
    m2, o2, s2 = make_training(99, steps=0)
    m2.load_state_dict(back["model"])
    o2.load_state_dict(back["optimizer"])
    s2.load_state_dict(back["scheduler"])
    idx = torch.randint(0, 97, (2, 8))
    for m, o in ((model, opt), (m2, o2)):
        m(idx).logsumexp(-1).mean().backward()
        o.step()
    for (n, p), (_, q) in zip(model.named_parameters(), m2.named_parameters()):
        assert torch.equal(p, q), n
    assert sched.get_last_lr() == s2.get_last_lr()


def test_tied_weights_stay_tied_and_noncontiguous_tensors(tmp_path):
    w = torch.randn(8, 4)
    state = {"a": w, "b": w, "t": w.t(), "slice": w[:, 1]}
    path = str(tmp_path / "tied.safetensors")
    run(C.save(state, path))
    back = run(C.load(path))
    assert back["a"] is back["b"]  # stored once, shared on load
    assert torch.equal(back["t"], w.t()) and torch.equal(back["slice"], w[:, 1])
    assert back["t"].is_contiguous()
    assert len(st.load_file(path)) == 3


def test_loaded_tensors_are_independent_and_writable(tmp_path):
    """Loaded tensors are views of one span of memory (tests/dsio/checkpoint/test_load_spans.py), but
    never overlap: writing one leaves its neighbours as they were saved."""
    state = {"x": torch.randn(1 << 19), "y": torch.randn(10), "z": torch.randn(10)}
    path = str(tmp_path / "w.safetensors")
    run(C.save(state, path))
    back = run(C.load(path))
    back["y"].add_(1)
    back["x"].fill_(7)
    assert torch.equal(back["z"], state["z"]) and torch.equal(back["y"], state["y"] + 1)


def test_unsupported_values_need_allow_pickle(tmp_path):
    path = str(tmp_path / "p.safetensors")

    class Custom:
        def __init__(self, v):
            self.v = v

        def __eq__(self, other):
            return type(other) is Custom and other.v == self.v

    state = {"w": torch.ones(2), "fn": {"nested": [Custom(3)]}}
    with pytest.raises(dsio.UnsupportedStateError, match=r"\['fn'\]\['nested'\]\[0\]"):
        run(C.save(state, path))
    assert not os.path.exists(path)
    state = {"w": torch.ones(2), "obj": random.Random(0)}
    run(C.save(state, path, allow_pickle=True))
    with pytest.raises(dsio.UnsupportedStateError):
        run(C.load(path))  # never unpickles unless asked
    back = run(C.load(path, allow_pickle=True))
    assert back["obj"].random() == random.Random(0).random()


def test_json_values_keep_their_types(tmp_path):
    state = {
        1: "int key",
        "f": 1.0,
        "i": 1,
        "nan": float("nan"),
        "ninf": float("-inf"),
        "t": (1, [2, (3,)]),
        "np": np.arange(6, dtype=np.int16).reshape(2, 3),
        "np_scalar": np.float32(0.5),
        "size": torch.Size([2, 3]),
        "dev": torch.device("cpu"),
        "empty": {},
        "emptyl": [],
    }
    path = str(tmp_path / "j.safetensors")
    run(C.save(state, path))
    assert_same(state, run(C.load(path)))


def test_top_level_tensor_and_empty_state(tmp_path):
    p1, p2 = str(tmp_path / "1.safetensors"), str(tmp_path / "2.safetensors")
    t = torch.arange(5.0)
    run(C.save(t, p1))
    assert torch.equal(run(C.load(p1)), t)
    run(C.save({}, p2))
    assert run(C.load(p2)) == {}
    assert st.load_file(p2) == {}


def test_save_replaces_a_larger_file(tmp_path):
    path = str(tmp_path / "r.safetensors")
    run(C.save({"x": torch.randn(1 << 20)}, path))
    run(C.save({"x": torch.randn(10)}, path))
    assert st.load_file(path)["x"].numel() == 10


def test_shared_handle_and_many_concurrent_files(tmp_path):
    async def main():
        async with dsio.AsyncIOHandle(C.DEFAULT_IO) as h:
            states = [{"x": torch.randn(1000 + i)} for i in range(8)]
            paths = [str(tmp_path / f"{i}.safetensors") for i in range(8)]
            await asyncio.gather(*(C.save(s, p, handle=h) for s, p in zip(states, paths)))
            backs = await asyncio.gather(*(C.load(p, handle=h) for p in paths))
            for s, b in zip(states, backs):
                assert torch.equal(s["x"], b["x"])

    run(main())


def test_missing_file_is_checkpoint_not_found(tmp_path):
    with pytest.raises(dsio.CheckpointNotFoundError):
        run(C.load(str(tmp_path / "nope.safetensors")))
    with pytest.raises(FileNotFoundError):  # it is also a FileNotFoundError
        run(C.load(str(tmp_path)))
