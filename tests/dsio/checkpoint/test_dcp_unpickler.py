"""The DCP metadata unpickler allows exact fully qualified names only (issue 9 item 2).

Each hostile ``.metadata`` below would run ``touch <marker>`` if unpickled by plain ``pickle``;
``DsioStorageReader.read_metadata`` must raise ``CheckpointFormatError`` and run nothing.
"""

from __future__ import annotations

import os
import pickle
import struct

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dsio.checkpoint.dcp import DsioStorageReader, DsioStorageWriter
from dsio.errors import CheckpointFormatError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

META = "torch.distributed.checkpoint.metadata"


def su(s: str) -> bytes:  # SHORT_BINUNICODE
    b = s.encode()
    return b"\x8c" + bytes([len(b)]) + b


def stack_global(module: str, name: str) -> bytes:  # protocol 4: dotted names are looked up by getattr chain
    return su(module) + su(name) + b"\x93"


def call(fn: bytes, *args: str) -> bytes:
    return fn + b"(" + b"".join(su(a) for a in args) + b"tR"  # MARK args TUPLE REDUCE


def proto4(body: bytes) -> bytes:
    return b"\x80\x04" + body + b"."


def hostile(marker: str) -> dict[str, bytes]:
    cmd = f"touch {marker}"
    return {
        # os.system reached *through* an allowed module (the bypass of a module-wide allowance)
        "dotted_through_metadata": proto4(call(stack_global(META, "os.system"), cmd)),
        "dotted_through_torch": proto4(call(stack_global("torch", "os.system"), cmd)),
        "dotted_through_dtype": proto4(call(stack_global("torch", "float32.__class__"), "x")),
        # protocol 0 GLOBAL with the same dotted name
        "global_opcode": b"c" + META.encode() + b"\nos.system\n(V" + cmd.encode() + b"\ntR.",
        # getattr chain: builtins.getattr(os-ish module, "system")(cmd)
        "getattr_chain": proto4(
            call(
                stack_global("builtins", "getattr"), "os", "system"
            )  # would need an os object: refused first
        ),
        "os_system_direct": proto4(call(stack_global("os", "system"), cmd)),
        "eval": proto4(call(stack_global("builtins", "eval"), f"__import__('os').system('{cmd}')")),
        "torch_load": proto4(call(stack_global("torch", "load"), marker)),
        "planner_module_member": proto4(
            call(stack_global("torch.distributed.checkpoint.planner", "os.system"), cmd)
        ),
        # REDUCE on allowed classes with arguments they reject
        "reduce_size_with_string": proto4(call(stack_global("torch", "Size"), "abc")),
        "reduce_storageinfo_garbage": proto4(
            call(stack_global("torch.distributed.checkpoint.filesystem", "_StorageInfo"), "a", "b", "c")
        ),
        "persistent_id": b"\x80\x04" + su("x") + b"Q.",
        "ext_code": b"\x80\x04\x82\x01.",  # copyreg extension 1 (unregistered)
        "truncated": b"\x80\x04\x95\xff\xff",
    }


@pytest.mark.parametrize("name", sorted(hostile("m")))
def test_hostile_metadata_is_refused_and_runs_nothing(tmp_path, name):
    marker = tmp_path / "pwned"
    (tmp_path / ".metadata").write_bytes(hostile(str(marker))[name])
    with pytest.raises(CheckpointFormatError):
        DsioStorageReader(tmp_path).read_metadata()
    assert not marker.exists()


def _valid(tmp_path):
    dcp.save({"w": torch.arange(4.0), "n": 3}, storage_writer=DsioStorageWriter(tmp_path))
    return (tmp_path / ".metadata").read_bytes()


def test_reduce_on_allowed_class_cannot_name_files_outside(tmp_path):
    """A well-formed pickle that builds an allowed _StorageInfo pointing outside / at a negative
    offset is refused by validation after unpickling."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    _valid(tmp_path)
    md = pickle.loads((tmp_path / ".metadata").read_bytes())
    for bad in (
        _StorageInfo("/etc/passwd", 0, 10),
        _StorageInfo("__0_0.distcp", -5, 10),
        _StorageInfo("x", 0, "9"),
    ):
        k = next(iter(md.storage_data))
        md.storage_data[k] = bad
        (tmp_path / ".metadata").write_bytes(pickle.dumps(md))
        r = DsioStorageReader(tmp_path)
        m = r.read_metadata()
        with pytest.raises(CheckpointFormatError):
            r.set_up_storage_reader(m, True)


def test_metadata_as_fifo_or_symlink_or_huge_is_refused_without_blocking(tmp_path):
    _valid(tmp_path)
    meta = tmp_path / ".metadata"
    os.unlink(meta)
    os.mkfifo(meta)
    with pytest.raises(CheckpointFormatError):
        DsioStorageReader(tmp_path).read_metadata()
    os.unlink(meta)
    os.symlink("/dev/zero", meta)
    with pytest.raises(CheckpointFormatError):
        DsioStorageReader(tmp_path).read_metadata()
    os.unlink(meta)
    with open(meta, "wb") as f:  # sparse, 2 GiB: refused by its size, never read
        f.truncate(2 << 30)
    with pytest.raises(CheckpointFormatError):
        DsioStorageReader(tmp_path).read_metadata()


def test_exact_allowlist_still_reads_real_metadata(tmp_path):
    raw = _valid(tmp_path)
    assert struct.unpack("<B", raw[1:2])[0] >= 2
    md = DsioStorageReader(tmp_path).read_metadata()
    assert set(md.state_dict_metadata) == {"w", "n"}
