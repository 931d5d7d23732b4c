"""The commit path's durability calls, recorded in order at the syscall level and checked.

``os.fsync``, ``os.rename``, ``renameat2(RENAME_EXCHANGE)`` and dsio's engine fsync are wrapped,
so the record is what really reached the kernel. For every save (new step, retention, re-save by
exchange, re-save by the fallback, recovery after a crash, the single-file save, DCP):

- R1: a file is fsynced before it is renamed into place (manifest, ``latest``, ``.metadata``);
- R2: the step directory is fsynced after its last file was made durable and before it is renamed;
- R3: every rank file is fsynced before the manifest that lists it is renamed into place;
- R4: after each rename the parent directory is fsynced before the save is reported done
  (renames of garbage, ``*.tmp`` to ``*.del.tmp``, excepted; a step retired to ``*.del.tmp``
  must be durably renamed before its files are deleted);
- R5: between a step's rename and ``latest``'s rename, the parent directory is fsynced.

``scripts/mutate_fsync.sh`` removes each sync of dsio/checkpoint in turn and shows this file failing.
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

import dsio.checkpoint as C
from dsio.checkpoint import _fs

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class Recorder:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[tuple[str, ...]] = []
        real_fsync, real_rename, real_x = os.fsync, os.rename, _fs._renameat2

        def fsync(fd: int) -> None:
            self.events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
            real_fsync(fd)

        def rename(src: str, dst: str) -> None:
            self.events.append(("rename", os.path.abspath(src), os.path.abspath(dst)))
            real_rename(src, dst)

        def exchange(d1, a, d2, b, flags):  # the ctypes renameat2
            self.events.append(("rename", os.fsdecode(a), os.fsdecode(b)))
            return real_x(d1, a, d2, b, flags)

        import dsio.file
        import dsio.handle

        def wrap_engine(real):
            async def engine_fsync(disp, ref):
                self.events.append(("fsync", os.path.abspath(ref.path)))
                return await real(disp, ref)

            return engine_fsync

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "rename", rename)
        if real_x is not None:
            monkeypatch.setattr(_fs, "_renameat2", exchange)
        monkeypatch.setattr(dsio.file, "fsync", wrap_engine(dsio.file.fsync))
        monkeypatch.setattr(dsio.handle, "_fsync", wrap_engine(dsio.handle._fsync))

    def mark(self, what: str) -> None:
        self.events.append(("done", what))


def _segments(events):
    seg: list[tuple[str, ...]] = []
    for e in events:
        if e[0] == "done":
            yield e[1], seg
            seg = []
        else:
            seg.append(e)


def check(events, *, root: str) -> list[str]:
    """Every violation of R1-R5 in the recorded events (empty = durable)."""
    bad: list[str] = []
    for name, seg in _segments(events):
        fsynced_at: dict[str, list[int]] = {}
        for i, e in enumerate(seg):
            if e[0] == "fsync":
                fsynced_at.setdefault(e[1], []).append(i)

        def synced_between(path: str, lo: int, hi: int, at: dict[str, list[int]] = fsynced_at) -> bool:
            return any(lo < j < hi for j in at.get(path, []))

        renames = [(i, e[1], e[2]) for i, e in enumerate(seg) if e[0] == "rename"]
        for i, src, dst in renames:
            garbage = dst.endswith(".del.tmp") and src.endswith(".tmp")  # a retired *step* is not garbage yet
            if not garbage and not synced_between(os.path.dirname(dst), i, len(seg)):
                bad.append(
                    f"{name}: R4 rename {os.path.basename(src)} -> {os.path.basename(dst)} not followed by fsync of its directory"
                )
            base = os.path.basename(dst)
            if base in ("manifest.json", "latest", ".metadata") and not synced_between(src, -1, i):
                bad.append(f"{name}: R1 {base} renamed into place before its data was fsynced")
            if base == "manifest.json":
                step_dir = os.path.dirname(dst)
                files = sorted(
                    {
                        e[1]
                        for e in seg[:i]
                        if e[0] == "fsync"
                        and os.path.dirname(e[1]) == step_dir
                        and e[1].endswith((".safetensors", ".pt"))
                    }
                )
                if not files:
                    bad.append(
                        f"{name}: R3 manifest renamed into {os.path.basename(step_dir)} before any rank file was fsynced"
                    )
            if (
                src.endswith(".tmp")
                and os.path.basename(src).startswith("step-")
                and os.path.basename(dst).startswith("step-")
                and not dst.endswith(".tmp")
                and os.path.dirname(src) == root
            ):
                # committing a step: its directory fsynced after the manifest went in, before this rename
                man = max(
                    (j for j, s2, d2 in renames if d2 == os.path.join(src, "manifest.json") and j < i),
                    default=None,
                )
                if man is not None and not synced_between(src, man, i):
                    bad.append(f"{name}: R2 {os.path.basename(src)} renamed before its directory was fsynced")
                later_latest = [j for j, s2, d2 in renames if j > i and os.path.basename(d2) == "latest"]
                if later_latest and not synced_between(root, i, later_latest[0]):
                    bad.append(f"{name}: R5 latest renamed before the step's rename was made durable")
        if name.startswith("save") and not any(os.path.basename(d) == "latest" for _, _, d in renames):
            bad.append(f"{name}: latest never updated")
    return bad


def _st(step: int, v: int = 0) -> dict:
    return {"w": torch.full((1000,), float(step * 10 + v)), "n": step}


def test_every_save_path_makes_each_rename_durable_in_order(tmp_path, monkeypatch):
    root = str(tmp_path / "run")
    rec = Recorder(monkeypatch)

    async def main() -> None:
        async with C.Checkpointer(root, keep_last=2) as ck:
            for s in (1, 2, 3):  # 3 retires 1
                await (await ck.save(s, _st(s)))
                await ck.wait()
                rec.mark(f"save {s}")
            await (await ck.save(3, _st(3, 1)))  # re-save: exchange where the filesystem can
            await ck.wait()
            rec.mark("save 3 again (exchange)")
            monkeypatch.setattr(_fs, "exchange_enabled", False)
            await (await ck.save(3, _st(3, 2)))  # re-save: the rename fallback
            await ck.wait()
            rec.mark("save 3 again (fallback)")
            assert ck.steps() == [2, 3]
            assert torch.equal((await ck.load())["w"], _st(3, 2)["w"])

    asyncio.run(main())
    events = rec.events
    kinds = [e for e in events if e[0] == "rename" and os.path.basename(e[2]).endswith(".del.tmp")]
    assert kinds, "retention and re-saves should have renamed something to *.del.tmp"
    assert check(events, root=root) == []


def test_recovery_restores_durably(tmp_path, monkeypatch):
    root = tmp_path / "run"

    async def seed() -> None:
        async with C.Checkpointer(root) as ck:
            await (await ck.save(4, _st(4)))

    asyncio.run(seed())
    # A crash in the middle of a fallback re-save: step-4 moved aside, the new copy not yet in place.
    os.rename(root / "step-000000004", root / "step-000000004.old.tmp")
    rec = Recorder(monkeypatch)
    ck = C.Checkpointer(root)
    try:
        ck._become_writer_sync()
        rec.mark("recover")
    finally:
        ck.close()
    ev = rec.events
    assert ("rename", str(root / "step-000000004.old.tmp"), str(root / "step-000000004")) in ev
    assert check(ev, root=str(root)) == []


def test_single_file_save_is_fsynced(tmp_path, monkeypatch):
    rec = Recorder(monkeypatch)
    path = str(tmp_path / "m.safetensors")
    asyncio.run(C.save(_st(1), path))
    assert ("fsync", path) in rec.events


def test_dcp_metadata_and_data_are_durable_in_order(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    rec = Recorder(monkeypatch)
    dcp.save({"w": torch.arange(10.0)}, storage_writer=C.DsioStorageWriter(tmp_path))
    rec.mark("dcp")
    ev = rec.events
    data = str(tmp_path / "__0_0.distcp")
    meta_rename = next(i for i, e in enumerate(ev) if e[0] == "rename" and e[2].endswith("/.metadata"))
    assert any(e == ("fsync", data) for e in ev[:meta_rename]), "data file not fsynced before .metadata"
    assert check(ev, root=str(tmp_path)) == []


def test_files_written_elsewhere_commit_durably_in_order(tmp_path, monkeypatch):
    """dstrain's torch.save fallback writes its rank files itself and commits them through
    ``commit_written``: the same rules hold (new step, re-save, a failed rank removes the step)."""
    root = str(tmp_path / "run")
    rec = Recorder(monkeypatch)
    names = ["rank-00000.pt", "rank-00001.pt"]

    def save(step: int, fill: bytes) -> None:
        tmp = C.step_tmp_dir(root, step)
        for n in names:
            C.write_rank_file(os.path.join(tmp, n), lambda f: f.write(fill))

    os.makedirs(root)
    save(1, b"one")
    C.commit_written(root, 1, names)
    rec.mark("save 1")
    save(1, b"two")
    C.commit_written(root, 1, names)
    rec.mark("save 1 again")
    assert check(rec.events, root=root) == []
    with open(os.path.join(root, "step-000000001", names[1]), "rb") as f:
        assert f.read() == b"two"
    with open(os.path.join(root, "latest")) as f:
        assert f.read().strip() == "step-000000001"
    save(2, b"three")
    with pytest.raises(C.CheckpointCommitError):
        C.commit_written(root, 2, names, failures=["rank 1: disk full"])
    assert sorted(os.listdir(root)) == ["latest", "step-000000001"]


def test_the_checker_catches_a_missing_sync():
    """The rules are not vacuous: a trace without the directory fsyncs is reported."""
    root = "/r"
    ev = [
        ("fsync", "/r/step-000000001.tmp/rank-00000.safetensors"),
        ("fsync", "/r/step-000000001.tmp/manifest.json.1.tmp"),
        ("rename", "/r/step-000000001.tmp/manifest.json.1.tmp", "/r/step-000000001.tmp/manifest.json"),
        ("rename", "/r/step-000000001.tmp", "/r/step-000000001"),
        ("fsync", "/r/latest.1.tmp"),
        ("rename", "/r/latest.1.tmp", "/r/latest"),
        ("fsync", "/r"),
        ("done", "save 1"),
    ]
    found = " ".join(check(ev, root=root))
    assert "R2" in found and "R5" in found and "R4" in found
