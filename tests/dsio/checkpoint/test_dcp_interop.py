"""DCP interop both ways: DsioStorageWriter -> stock FileSystemReader, stock FileSystemWriter ->
DsioStorageReader, with dcp.save and dcp.async_save; bytes items included."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

import dsio
from dsio.checkpoint.dcp import DsioStorageReader, DsioStorageWriter

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Linear(24, 4))
    return {
        "model": m.state_dict(),
        "bf16": torch.randn(17).bfloat16(),
        "i64": torch.arange(7),
        "view": torch.arange(40.0)[5:25],  # a view: only its own elements are stored
        "step": 3,
        "name": "run",
    }


def _empty() -> dict:
    s = _state(99)
    return {
        "model": {k: torch.zeros_like(v) for k, v in s["model"].items()},
        "bf16": torch.zeros(17).bfloat16(),
        "i64": torch.zeros(7, dtype=torch.int64),
        "view": torch.zeros(20),
        "step": 0,
        "name": "",
    }


def _check(a: dict, b: dict) -> None:
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for k in ("bf16", "i64", "view"):
        assert torch.equal(a[k], b[k]), k
    assert a["step"] == b["step"] and a["name"] == b["name"]


def _save(kind: str, sd: dict, path, writer) -> None:
    if kind == "sync":
        dcp.save(sd, storage_writer=writer)
    else:
        dcp.async_save(sd, storage_writer=writer).result()


@pytest.mark.parametrize("kind", ["sync", "async_save"])
def test_dsio_writer_is_read_by_stock_filesystem_reader(tmp_path, kind):
    sd = _state()
    _save(kind, sd, tmp_path, DsioStorageWriter(tmp_path))
    back = _empty()
    dcp.load(back, storage_reader=FileSystemReader(tmp_path))
    _check(sd, back)


@pytest.mark.parametrize("kind", ["sync", "async_save"])
def test_stock_filesystem_writer_is_read_by_dsio_reader(tmp_path, kind):
    sd = _state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _save(kind, sd, tmp_path, FileSystemWriter(tmp_path))
    back = _empty()
    dcp.load(back, storage_reader=DsioStorageReader(tmp_path))
    _check(sd, back)


def test_dsio_items_carry_a_crc_that_stock_ignores_and_dsio_checks(tmp_path):
    sd = _state()
    dcp.save(sd, storage_writer=DsioStorageWriter(tmp_path))
    md = DsioStorageReader(tmp_path).read_metadata()
    infos = list(md.storage_data.values())
    assert infos and all(type(getattr(i, "crc32c", None)) is int for i in infos)
    # Flip a byte inside a tensor record's data: the stock reader cannot tell, dsio's can.
    big = max(infos, key=lambda i: i.length)
    f = tmp_path / big.relative_path
    raw = bytearray(f.read_bytes())
    raw[big.offset + big.length - 40] ^= 0x01
    f.write_bytes(bytes(raw))
    from torch.distributed.checkpoint.api import CheckpointException

    with pytest.raises((dsio.ChecksumError, CheckpointException)) as ei:
        dcp.load(_empty(), storage_reader=DsioStorageReader(tmp_path))
    if isinstance(ei.value, CheckpointException):
        assert all(isinstance(x[0], dsio.ChecksumError) for x in ei.value.failures.values())


def test_the_writer_skips_torchs_zip_crc_from_the_first_save_of_a_process():
    # torch.save imports its serialization config on its first call: in a fresh process the writer's
    # first save must skip the zip CRC-32 pass as its later ones do (every item carries a crc32c)
    code = (
        "import sys\n"
        "from dsio.checkpoint._dcp_records import no_zip_crc32\n"
        "assert 'torch.utils.serialization' not in sys.modules  # nothing has saved yet\n"
        "with no_zip_crc32():\n"
        "    from torch.utils.serialization import config\n"
        "    assert config.save.compute_crc32 is False\n"
        "assert config.save.compute_crc32 is True\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
