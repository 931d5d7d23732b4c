"""DCP metadata written by a Python that pickles enum members as ``getattr(EnumClass, "NAME")``
(3.11.2 does; 3.11.7 pickles ``EnumClass(value)``) loads, and getattr stays refused for anything else."""

from __future__ import annotations

import io

import pytest
from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

from dsio.checkpoint.dcp import _MetadataUnpickler
from dsio.errors import CheckpointFormatError

META = "torch.distributed.checkpoint.metadata"


def su(s: str) -> bytes:
    b = s.encode()
    return b"\x8c" + bytes([len(b)]) + b


def glob(module: str, name: str) -> bytes:
    return su(module) + su(name) + b"\x93"


def getattr_pickle(obj: bytes, name: str) -> bytes:
    # protocol 4: getattr, (obj, name), REDUCE -- what enum's __reduce_ex__ gave on Python 3.11.2
    return b"\x80\x04" + glob("builtins", "getattr") + obj + su(name) + b"\x86R."


def load(data: bytes) -> object:
    return _MetadataUnpickler(io.BytesIO(data)).load()


def test_enum_member_pickled_through_getattr_loads() -> None:
    for member in _MEM_FORMAT_ENCODING:
        assert load(getattr_pickle(glob(META, "_MEM_FORMAT_ENCODING"), member.name)) is member


@pytest.mark.parametrize(
    "obj,name",
    [
        (glob(META, "_MEM_FORMAT_ENCODING"), "__class__"),  # not a member
        (glob(META, "_MEM_FORMAT_ENCODING"), "_member_map_"),
        (glob(META, "Metadata"), "__init__"),  # allowed class, but no enum
        (glob("torch", "Size"), "__new__"),
        (su("os"), "system"),  # a string, not a class
    ],
)
def test_getattr_on_anything_else_is_refused(obj: bytes, name: str) -> None:
    with pytest.raises(CheckpointFormatError):
        load(getattr_pickle(obj, name))
