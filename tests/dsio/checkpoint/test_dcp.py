"""The DCP storage plugin in one process: save/load/async_save, integrity, hostile metadata."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

import dsio
from dsio.checkpoint.dcp import DsioStorageInfo, DsioStorageReader, DsioStorageWriter

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(4, 32)).sum().backward()
    opt.step()
    return {"model": m.state_dict(), "bf16": torch.randn(17).bfloat16(), "step": 3, "name": "run"}


def _empty() -> dict:
    s = _state(99)
    return {
        "model": {k: torch.zeros_like(v) for k, v in s["model"].items()},
        "bf16": torch.zeros(17).bfloat16(),
        "step": 0,
        "name": "",
    }


def _raises(exc_type, fn, *args, match: str | None = None, **kwargs):
    """DCP wraps a rank's exception in CheckpointException(failures={rank: (exc, tb)})."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        fn(*args, **kwargs)
    except CheckpointException as e:
        inner = [f[0] for f in e.failures.values()]
        assert inner and all(isinstance(x, exc_type) for x in inner), inner
        if match:
            assert any(match in str(x) for x in inner), inner
        return
    except exc_type as e:
        if match:
            assert match in str(e)
        return
    raise AssertionError(f"{exc_type.__name__} not raised")


def _check(a: dict, b: dict) -> None:
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert torch.equal(a["bf16"], b["bf16"]) and a["step"] == b["step"] and a["name"] == b["name"]


def test_save_and_load(tmp_path):
    sd = _state()
    dcp.save(sd, storage_writer=DsioStorageWriter(tmp_path))
    assert sorted(os.listdir(tmp_path)) == [".metadata", "__0_0.distcp"]
    back = _empty()
    dcp.load(back, storage_reader=DsioStorageReader(tmp_path))
    _check(sd, back)


def test_async_save(tmp_path):
    sd = _state()
    fut = dcp.async_save(sd, storage_writer=DsioStorageWriter(tmp_path))
    fut.result()
    back = _empty()
    dcp.load(back, storage_reader=DsioStorageReader(tmp_path))
    _check(sd, back)


def test_checkpoint_id_form_and_running_event_loop(tmp_path):
    import asyncio

    sd = _state()

    async def inside_a_loop():  # DCP called from async code: dsio runs its own loop on a thread
        dcp.save(sd, checkpoint_id=str(tmp_path), storage_writer=DsioStorageWriter(""))
        back = _empty()
        dcp.load(back, checkpoint_id=str(tmp_path), storage_reader=DsioStorageReader(""))
        return back

    _check(sd, asyncio.run(inside_a_loop()))


def test_flipped_byte_is_checksum_error(tmp_path):
    dcp.save(_state(), storage_writer=DsioStorageWriter(tmp_path))
    data = tmp_path / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(bytes(raw))
    _raises(
        dsio.ChecksumError, dcp.load, _empty(), storage_reader=DsioStorageReader(tmp_path), match="model."
    )


def _rewrite_metadata(path, fn) -> None:
    with open(path / ".metadata", "rb") as f:
        md = pickle.load(f)
    fn(md)
    with open(path / ".metadata", "wb") as f:
        pickle.dump(md, f)


@pytest.mark.parametrize("bad", ["../x.distcp", "/etc/passwd", ".."])
def test_metadata_naming_a_path_outside_is_rejected(tmp_path, bad):
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    dcp.save(_state(), storage_writer=DsioStorageWriter(tmp_path))

    def evil(md):
        k = next(iter(md.storage_data))
        i = md.storage_data[k]
        md.storage_data[k] = _StorageInfo(bad, i.offset, i.length)

    _rewrite_metadata(tmp_path, evil)
    _raises(dsio.errors.CheckpointFormatError, dcp.load, _empty(), storage_reader=DsioStorageReader(tmp_path))


def test_legacy_raw_items_still_load_and_are_validated(tmp_path):
    """Checkpoints of earlier dsio versions (DsioStorageInfo: raw bytes) still load; a raw item whose
    dtype and shape do not fit its bytes is refused."""
    from dsio.checkpoint._integrity import crc_of

    sd = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}
    raw = sd["w"].numpy().tobytes()
    (tmp_path / "__0_0.distcp").write_bytes(raw)
    dcp.save({"w": torch.zeros(3, 4)}, storage_writer=DsioStorageWriter(tmp_path / "tmpl"))

    def legacy(md, shape=(3, 4)):
        k = next(iter(md.storage_data))
        buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        md.storage_data[k] = DsioStorageInfo(
            "__0_0.distcp", 0, len(raw), crc_of(buf.data_ptr(), len(raw)), "F32", shape
        )

    with open(tmp_path / "tmpl" / ".metadata", "rb") as f:
        md = pickle.load(f)
    legacy(md)
    with open(tmp_path / ".metadata", "wb") as f:
        pickle.dump(md, f)
    back = {"w": torch.zeros(3, 4)}
    dcp.load(back, storage_reader=DsioStorageReader(tmp_path))
    assert torch.equal(back["w"], sd["w"])
    legacy(md, shape=(4, 4))
    with open(tmp_path / ".metadata", "wb") as f:
        pickle.dump(md, f)
    _raises(
        dsio.errors.CheckpointFormatError,
        dcp.load,
        {"w": torch.zeros(3, 4)},
        storage_reader=DsioStorageReader(tmp_path),
    )


class _Boom:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_metadata_with_arbitrary_globals_is_not_unpickled(tmp_path):
    dcp.save(_state(), storage_writer=DsioStorageWriter(tmp_path))
    with open(tmp_path / ".metadata", "wb") as f:
        pickle.dump(_Boom(str(tmp_path / "pwned")), f)
    with pytest.raises(dsio.errors.CheckpointFormatError):
        DsioStorageReader(tmp_path).read_metadata()
    # Through DCP the error arrives wrapped ("metadata is None ... read failed"); still nothing ran.
    _raises(Exception, dcp.load, _empty(), storage_reader=DsioStorageReader(tmp_path))
    assert not (tmp_path / "pwned").exists()
