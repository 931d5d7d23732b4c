"""dstrain.checkpoint.state.restore: entries read into memory are applied within bounded memory, and a
corrupted file still fails the load with nothing applied."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import dsio
import dsio.checkpoint
from dstrain.checkpoint import state as S

ENTRY = 32 << 20  # bytes per entry: over glibc's largest mmap threshold, so a freed entry leaves RSS
KEYS = ("a", "b", "c", "d")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class _Part:
    """Copies its entry into memory it owns (as the zero master does) and records, when it is handed
    its entry, how much more memory the process holds than before the restore began."""

    def __init__(self, log: list[tuple[str, int]], key: str, base: list[int]) -> None:
        self.log, self.key, self.base = log, key, base
        self.mine = torch.zeros(ENTRY // 4)

    def state_dict(self) -> Any:
        return {"w": self.mine}

    def load_state_dict(self, state: Any) -> None:
        self.log.append((self.key, _rss() - self.base[0]))
        self.mine.copy_(state["w"])


def _save(path: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    values = {k: torch.randn(ENTRY // 4, generator=g) for k in KEYS}
    state = {"format": S.FORMAT, **{k: {"w": v} for k, v in values.items()}}
    dsio.run_sync(dsio.checkpoint.save(state, path))
    return values


def _load_lazy(path: str) -> dict[str, Any]:
    """The state with every tensor over 1 MiB left in the file (`StoredTensor`s)."""

    async def main() -> Any:
        handle = dsio.AsyncIOHandle(dsio.checkpoint.DEFAULT_IO)  # the stored tensors read with it
        return await dsio.checkpoint.load(path, lazy_from=1 << 20, handle=handle)

    return dsio.run_sync(main())


def _restore(path: str) -> tuple[dict[str, _Part], list[tuple[str, int]]]:
    log: list[tuple[str, int]] = []
    base = [0]
    parts = {k: _Part(log, k, base) for k in KEYS}
    state = _load_lazy(path)
    assert isinstance(state["a"]["w"], dsio.checkpoint.StoredTensor)
    base[0] = _rss()
    S.restore(parts, state, where=path, skip=set())
    return parts, log


def test_entries_over_the_bound_are_applied_one_at_a_time(tmp_path, monkeypatch) -> None:
    """Over `EAGER_BYTES`, a part is handed its entry while the process holds at most about one entry
    more than before the restore; within it (the control, same run, same file), all four entries are
    held when the first part gets its own. Measured here: 1.5 entries (the entry being applied, plus
    the reading handles' pinned pools) vs 4.0; bounds with margins both ways: at most 2.25 entries
    bounded, at least 3.5 in the control."""
    path = str(tmp_path / "state.safetensors")
    values = _save(path)
    parts, eager_log = _restore(path)  # 128 MiB of entries <= EAGER_BYTES: all read, then applied
    assert [k for k, _ in eager_log] == list(KEYS)
    assert eager_log[0][1] >= 3.5 * ENTRY, eager_log
    del parts
    monkeypatch.setattr(S, "EAGER_BYTES", ENTRY // 2)
    parts, log = _restore(path)
    assert [k for k, _ in log] == list(KEYS)
    growth = max(g for _, g in log)
    assert growth <= 2.25 * ENTRY, (log, eager_log)
    for k in KEYS:
        assert torch.equal(parts[k].mine, values[k]), k


@pytest.mark.parametrize("bound", ["within", "over"])
def test_a_flipped_bit_in_the_last_entry_fails_the_restore_with_nothing_applied(
    tmp_path, monkeypatch, bound: str
) -> None:
    path = str(tmp_path / "state.safetensors")
    _save(path)
    with open(path, "r+b") as f:  # a bit in the middle of the last entry's tensor (file order = KEYS)
        size = os.fstat(f.fileno()).st_size
        f.seek(size - ENTRY // 2)
        b = f.read(1)
        f.seek(size - ENTRY // 2)
        f.write(bytes([b[0] ^ 0x08]))
    if bound == "over":
        monkeypatch.setattr(S, "EAGER_BYTES", ENTRY // 2)
    log: list[tuple[str, int]] = []
    parts = {k: _Part(log, k, [0]) for k in KEYS}
    state = _load_lazy(path)
    with pytest.raises(dsio.ChecksumError):
        S.restore(parts, state, where=path, skip=set())
    assert log == []  # no part was handed its entry
    assert all(not p.mine.any() for p in parts.values())
