"""Every malformed input is a CheckpointFormatError (issue 9 item 7): explicit cases, the crashing
inputs the fuzzers found, and the fuzzers themselves (hypothesis, bounded, derandomized)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dsio
import dsio.checkpoint as C
from dsio.checkpoint._format import parse_header
from dsio.checkpoint._state import flatten, unflatten
from dsio.errors import CheckpointFormatError, ChecksumError, UnsupportedStateError

FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _header(obj) -> bytes:
    return json.dumps(obj).encode()


def _parse(raw: bytes, size: int | None = None):
    return parse_header(raw, 8 + len(raw) if size is None else size, "f.safetensors")


# -- header: explicit cases (each one crashed with a raw error before) -----------------------------
HEADER_CASES = {
    "dtype_as_list": _header({"x": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}),
    "dtype_as_dict": _header({"x": {"dtype": {"a": 1}, "shape": [1], "data_offsets": [0, 4]}}),
    "shape_overflow_with_zero": _header({"x": {"dtype": "F32", "shape": [2**63, 0], "data_offsets": [0, 0]}}),
    "shape_product_overflow_with_zero": _header(
        {"x": {"dtype": "F32", "shape": [2**40, 2**30, 0], "data_offsets": [0, 0]}}
    ),
    "shape_huge_product": _header({"x": {"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 4]}}),
    "too_many_dims": _header({"x": {"dtype": "F32", "shape": [1] * 100, "data_offsets": [0, 4]}}),
    "nested_100k": b"[" * 100_000 + b"]" * 100_000,
    "nested_100k_in_entry": b'{"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "offsets_not_ints": _header({"x": {"dtype": "F32", "shape": [1], "data_offsets": ["0", "4"]}}),
    "entry_is_list": _header({"x": [1, 2]}),
    "metadata_not_strings": _header({"__metadata__": {"a": 1}}),
    "not_utf8": b"\xff\xfe{}",
    # found by test_fuzz_header_parser on the code before this fix (TypeError: unhashable list)
    "fuzz_dtype_empty_list": _header({"": {"dtype": []}}),
}


def _data_bytes(raw: bytes) -> int:
    """The data section size the header itself claims, so that only its malformation is wrong
    (a file size that does not match would be refused for that reason alone)."""
    try:
        obj = json.loads(raw)
        offs = [v.get("data_offsets") for v in obj.values() if isinstance(v, dict)]
        return max(
            (o[1] for o in offs if isinstance(o, list) and len(o) == 2 and type(o[1]) is int), default=0
        )
    except (ValueError, RecursionError, AttributeError):
        return 0


@pytest.mark.parametrize("name", sorted(HEADER_CASES))
def test_malformed_header_is_format_error(name):
    raw = HEADER_CASES[name]
    with pytest.raises(CheckpointFormatError):
        _parse(raw, 8 + len(raw) + _data_bytes(raw))


def test_shape_overflow_in_a_file_is_format_error_not_a_torch_error(tmp_path):
    hdr = json.dumps({"x": {"dtype": "F32", "shape": [2**40, 2**30, 0], "data_offsets": [0, 0]}}).encode()
    path = tmp_path / "f.safetensors"
    path.write_bytes(struct.pack("<Q", len(hdr)) + hdr)
    with pytest.raises(CheckpointFormatError):
        asyncio.run(C.load(str(path)))


# -- state tree: explicit cases -------------------------------------------------------------------
TREE_CASES = {
    "bad_base64": {"b": "!!!not base64!!!"},
    "base64_not_str": {"b": 5},
    "dict_node_not_list": {"d": 5},
    "dict_entry_not_pair": {"d": [[1]]},
    "dict_key_unhashable": {"d": [[[1, 2], {"v": 1}]]},
    "list_node_not_list": {"l": "abc"},
    "tuple_node_dict": {"u": {"a": 1}},
    "scalar_holds_container": {"v": {"x": 1}},
    "float_garbage": {"f": "abc"},
    "dtype_not_str": {"dt": 5},
    "dtype_not_dtype": {"dt": "Tensor"},
    "dtype_dunder": {"dt": "__class__"},
    "size_of_strings": {"sz": ["a"]},
    "size_overflow": {"sz": [2**64]},
    "device_bogus": {"dev": "bogus:99"},
    "device_not_str": {"dev": 5},
    "np_scalar_shape": {"ns": 5},
    "np_scalar_object_dtype": {"ns": ["O", 1]},
    "np_scalar_bad_dtype": {"ns": ["not-a-dtype", 1]},
    "np_array_bad_dtype": {"a": "t", "npdt": 5},
    "np_array_itemsize_mismatch": {"a": "t", "npdt": "<f8"},
    "tensor_name_not_str": {"t": [1]},
    "tensor_missing": {"t": "nope"},
    "unknown_node": {"zz": 1},
    "empty_node": {},
    "not_a_node": [1, 2],
    "deep_lists": None,  # built below
    # found by test_fuzz_state_tree_decoder on the code before this fix (raw TypeError/ValueError)
    "fuzz_sz_none": {"sz": None},
    "fuzz_dt_none": {"dt": None},
    "fuzz_u_none": {"u": None},
    "fuzz_l_none": {"l": None},
    "fuzz_d_none": {"d": None},
    "fuzz_b_none": {"b": None},
    "fuzz_f_none": {"f": None},
}


def _deep(n: int):
    node: dict = {"v": 1}
    for _ in range(n):
        node = {"l": [node]}
    return node


@pytest.mark.parametrize("name", sorted(TREE_CASES))
def test_malformed_state_tree_is_format_error(name):
    tree = _deep(100_000) if name == "deep_lists" else TREE_CASES[name]
    with pytest.raises(CheckpointFormatError):
        unflatten(tree, {"t": torch.zeros(3, dtype=torch.float32)})


def test_pickled_node_without_permission_is_unsupported_not_unpickled():
    with pytest.raises(UnsupportedStateError):
        unflatten({"p": base64.b64encode(b"cos\nsystem\n(S'true'\ntR.").decode()}, {})


def _file_with_state(tmp_path, state_json: str) -> str:
    hdr = json.dumps({"__metadata__": {"dsio.state": state_json}}).encode()
    path = tmp_path / "f.safetensors"
    path.write_bytes(struct.pack("<Q", len(hdr)) + hdr)
    return str(path)


def test_state_json_nested_100k_deep_in_a_file_is_format_error(tmp_path):
    path = _file_with_state(tmp_path, "[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointFormatError):
        asyncio.run(C.load(path))
    path = _file_with_state(tmp_path, json.dumps(_deep(300)))
    with pytest.raises(CheckpointFormatError):
        asyncio.run(C.load(path))


def test_bad_base64_in_a_file_is_format_error_not_empty_bytes(tmp_path):
    path = _file_with_state(tmp_path, json.dumps({"d": [["raw", {"b": "@@@@"}]]}))
    with pytest.raises(CheckpointFormatError):
        asyncio.run(C.load(path))


def test_real_states_still_round_trip_through_the_strict_decoder():
    import numpy as np

    state = {
        "a": np.arange(6, dtype=np.int16).reshape(2, 3),
        "z": np.float32(1.5),
        "b": b"\x00\xff",
        "t": (1, [2.5, float("inf")], None),
        "dt": torch.bfloat16,
        "sz": torch.Size([2, 3]),
        "dev": torch.device("cpu"),
        "x": torch.ones(2),
        "scalar0d": np.array(3.0),
    }
    tensors, tree = flatten(state)
    back = unflatten(json.loads(json.dumps(tree)), tensors)
    assert back["b"] == state["b"] and back["t"] == state["t"] and back["dt"] is torch.bfloat16
    assert np.array_equal(back["a"], state["a"]) and back["a"].dtype == np.int16
    assert back["z"] == state["z"] and back["sz"] == state["sz"] and back["dev"] == state["dev"]
    assert np.array_equal(back["scalar0d"], state["scalar0d"])


# -- fuzzers --------------------------------------------------------------------------------------
json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)
json_value = st.recursive(
    json_leaf,
    lambda kids: st.one_of(
        st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=6), kids, max_size=4)
    ),
    max_leaves=25,
)
node_keys = st.sampled_from(
    ["t", "a", "v", "f", "b", "d", "o", "l", "u", "dt", "sz", "dev", "ns", "npdt", "p", "x"]
)
tree_node = st.recursive(
    st.dictionaries(node_keys, json_value, min_size=1, max_size=3),
    lambda kids: st.one_of(
        st.builds(lambda xs: {"l": xs}, st.lists(kids, max_size=3)),
        st.builds(lambda xs: {"u": xs}, st.lists(kids, max_size=3)),
        st.builds(
            lambda kv: {"d": [[k, v] for k, v in kv]}, st.lists(st.tuples(json_leaf, kids), max_size=3)
        ),
        st.dictionaries(node_keys, st.one_of(json_value, kids), min_size=1, max_size=3),
    ),
    max_leaves=20,
)
entry = st.fixed_dictionaries(
    {},
    optional={
        "dtype": st.one_of(st.sampled_from(["F32", "BF16", "I64", "BOOL", "F99"]), json_value),
        "shape": st.one_of(st.lists(st.integers(min_value=-2, max_value=2**64), max_size=4), json_value),
        "data_offsets": st.one_of(
            st.lists(st.integers(min_value=-2, max_value=2**64), max_size=3), json_value
        ),
    },
)
header_obj = st.dictionaries(
    st.one_of(st.text(max_size=6), st.just("__metadata__")),
    st.one_of(entry, json_value, st.dictionaries(st.text(max_size=6), st.text(max_size=6), max_size=3)),
    max_size=4,
)


@FUZZ
@given(header_obj, st.integers(min_value=0, max_value=1 << 20))
def test_fuzz_header_parser(obj, extra):
    raw = json.dumps(obj).encode()
    try:
        h = _parse(raw, 8 + len(raw) + extra)
    except (CheckpointFormatError, ChecksumError):
        return
    for e in h.entries:  # what parses is usable: torch can make these tensors
        torch.empty(e.shape, dtype=e.dtype, device="meta")


@FUZZ
@given(st.binary(max_size=256))
def test_fuzz_header_parser_on_bytes(raw):
    with contextlib.suppress(CheckpointFormatError, ChecksumError):
        _parse(raw, 8 + len(raw) + 16)


@FUZZ
@given(tree_node)
def test_fuzz_state_tree_decoder(tree):
    tensors = {"t": torch.zeros(2), "x": torch.zeros(4, dtype=torch.uint8)}
    with contextlib.suppress(CheckpointFormatError, UnsupportedStateError):
        unflatten(tree, tensors, allow_pickle=False)


def test_format_errors_are_dsio_errors():
    assert issubclass(CheckpointFormatError, dsio.DsioError)
