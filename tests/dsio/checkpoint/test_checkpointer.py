"""Checkpointer: async save semantics, commit layout, retention, statistics, lookup errors."""

from __future__ import annotations

import asyncio
import json
import os

import pytest
import safetensors.torch as st
import torch
from ckpt_helpers import assert_same, make_state

import dsio
import dsio.checkpoint as C


def run(coro):
    return asyncio.run(coro)


def test_save_without_background_staging_returns_after_staging_and_training_may_mutate(tmp_path):
    async def main():
        state = make_state(seed=1)
        expect = {"w": state["model"]["wte.weight"].clone()}
        async with C.Checkpointer(tmp_path, keep_last=3) as ck:
            task = await ck.save(100, state, background_staging=False)
            assert isinstance(task, asyncio.Task)
            # Training continues and overwrites its tensors while the save is being written.
            for t in state["model"].values():
                t.zero_()
            res = await task
            assert res.step == 100 and res.bytes > 0
            assert res.path == os.path.join(str(tmp_path), "step-000000100")
            back = await ck.load()
            assert torch.equal(back["model"]["wte.weight"], expect["w"])
            assert back["step"] == 2

    run(main())


def test_layout_latest_steps_and_retention(tmp_path):
    async def main():
        async with C.Checkpointer(tmp_path, keep_last=2) as ck:
            for step in (10, 20, 30, 40):
                await (await ck.save(step, {"step": step, "w": torch.full((3,), float(step))}))
            assert ck.steps() == [30, 40]  # retired steps stop being steps at once
            assert ck.latest_step() == 40
            await ck.wait()  # ...and are deleted in the background
            assert sorted(os.listdir(tmp_path)) == [
                "latest",
                "step-000000030",
                "step-000000040",
                "writer.lock",
            ]
            assert (tmp_path / "latest").read_text() == "step-000000040\n"
            d = tmp_path / "step-000000040"
            assert sorted(os.listdir(d)) == ["manifest.json", "rank-00000.safetensors"]
            m = json.loads((d / "manifest.json").read_text())
            assert m["world_size"] == 1 and m["step"] == 40
            assert m["files"] == [
                {
                    "rank": 0,
                    "path": "rank-00000.safetensors",
                    "bytes": os.path.getsize(d / "rank-00000.safetensors"),
                }
            ]
            # Each rank file is a stock safetensors file.
            assert torch.equal(st.load_file(str(d / "rank-00000.safetensors"))["w"], torch.full((3,), 40.0))
            assert (await ck.load(step=30))["step"] == 30
            assert (await ck.load())["step"] == 40
            with pytest.raises(dsio.CheckpointNotFoundError):
                await ck.load(step=10)

    run(main())


def test_round_trip_realistic_state(tmp_path):
    async def main():
        state = make_state(seed=5, steps=3)
        async with C.Checkpointer(tmp_path) as ck:
            await (await ck.save(3, state))
        async with C.Checkpointer(tmp_path) as ck2:  # a new process would do the same
            assert_same(state, await ck2.load())

    run(main())


def test_one_save_in_flight_second_waits(tmp_path):
    async def main():
        big = {"w": torch.randn(16 << 20)}  # 64 MiB: the first save is still writing
        async with C.Checkpointer(tmp_path) as ck:
            t1 = await ck.save(1, big)
            t2 = await ck.save(2, big)
            assert t1.done()  # save(2) returned only after save(1) finished
            await t2
            st_ = ck.statistics()
            assert st_.saves == 2 and st_.failed_saves == 0 and not st_.in_flight
            assert st_.last_wait_seconds > 0 and st_.last_blocked_seconds >= st_.last_staging_seconds
            assert st_.last_step == 2 and st_.last_bytes > 64 << 20
            assert st_.bytes_written_total == 2 * st_.last_bytes
            assert st_.last_throughput_bytes_per_s > 0
            assert st_.staging_buffer_bytes >= st_.last_bytes
            with pytest.raises(dataclasses_FrozenInstanceError()):
                st_.saves = 0  # type: ignore[misc]

    run(main())


def dataclasses_FrozenInstanceError():
    import dataclasses

    return dataclasses.FrozenInstanceError


def test_unsupported_state_raises_from_save_and_commits_nothing(tmp_path):
    async def main():
        async with C.Checkpointer(tmp_path) as ck:
            with pytest.raises(dsio.UnsupportedStateError):
                await ck.save(1, {"f": lambda: 1})
            await asyncio.sleep(0.05)
            assert ck.steps() == [] and ck.statistics().failed_saves == 1
            assert [n for n in os.listdir(tmp_path) if n != "writer.lock"] == []
            await (await ck.save(2, {"ok": torch.ones(1)}))
            assert ck.steps() == [2]

    run(main())


def test_leftover_tmp_invisible_to_readers_and_cleaned_by_the_writer(tmp_path):
    (tmp_path / "step-000000007.tmp").mkdir()
    (tmp_path / "step-000000007.tmp" / "rank-00000.safetensors").write_bytes(b"partial")
    (tmp_path / "latest.123.tmp").write_text("junk")
    ck = C.Checkpointer(tmp_path)
    try:
        assert ck.steps() == []
        with pytest.raises(dsio.CheckpointNotFoundError):
            run(ck.load())
        # A reader changes nothing (the .tmp may be a live save of another process)...
        assert sorted(os.listdir(tmp_path)) == ["latest.123.tmp", "step-000000007.tmp"]

        async def save():  # ...the writer, once it holds the lock, cleans up.
            await (await ck.save(1, {"x": torch.ones(1)}))

        run(save())
        assert sorted(os.listdir(tmp_path)) == ["latest", "step-000000001", "writer.lock"]
    finally:
        ck.close()


def test_same_step_saved_twice_replaces(tmp_path):
    async def main():
        async with C.Checkpointer(tmp_path) as ck:
            await (await ck.save(5, {"v": torch.zeros(2)}))
            await (await ck.save(5, {"v": torch.ones(2)}))
            assert ck.steps() == [5]
            assert torch.equal((await ck.load())["v"], torch.ones(2))
            assert sorted(os.listdir(tmp_path)) == ["latest", "step-000000005", "writer.lock"]

    run(main())


def test_world_size_mismatch_is_a_clear_error(tmp_path):
    async def main():
        async with C.Checkpointer(tmp_path) as ck:
            await (await ck.save(1, {"v": torch.zeros(2)}))
            mpath = tmp_path / "step-000000001" / "manifest.json"
            m = json.loads(mpath.read_text())
            m["world_size"] = 2
            mpath.write_text(json.dumps(m))
            with pytest.raises(dsio.errors.CheckpointMismatchError):
                await ck.load()

    run(main())


@pytest.mark.parametrize(
    "bad", ["../outside.safetensors", "/etc/passwd", "sub/../../x", "..", "link.safetensors"]
)
def test_manifest_naming_a_path_outside_is_rejected(tmp_path, bad):
    async def main():
        root = tmp_path / "run"
        outside = tmp_path / "outside.safetensors"
        await C.save({"v": torch.zeros(2)}, str(outside))
        async with C.Checkpointer(root) as ck:
            await (await ck.save(1, {"v": torch.ones(2)}))
            d = root / "step-000000001"
            if bad == "link.safetensors":
                os.symlink(outside, d / bad)
            mpath = d / "manifest.json"
            m = json.loads(mpath.read_text())
            m["files"][0]["path"] = bad
            m["files"][0]["bytes"] = os.path.getsize(outside)
            mpath.write_text(json.dumps(m))
            with pytest.raises(dsio.errors.CheckpointFormatError):
                await ck.load()

    run(main())


def test_latest_naming_outside_is_rejected(tmp_path):
    async def main():
        async with C.Checkpointer(tmp_path) as ck:
            await (await ck.save(1, {"v": torch.ones(2)}))
            (tmp_path / "latest").write_text("../../etc\n")
            with pytest.raises(dsio.errors.CheckpointFormatError):
                await ck.load()
            assert torch.equal((await ck.load(step=1))["v"], torch.ones(2))

    run(main())


def test_close_releases_pinned_memory_and_rejects_use(tmp_path):
    async def main():
        ck = C.Checkpointer(tmp_path)
        await (await ck.save(1, {"v": torch.ones(1 << 16)}))
        assert ck.statistics().staging_buffer_bytes > 0
        await ck.aclose()
        assert ck.statistics().staging_buffer_bytes == 0
        with pytest.raises(dsio.ClosedError):
            await ck.save(2, {"v": torch.ones(1)})

    run(main())


def test_invalid_arguments(tmp_path):
    with pytest.raises(ValueError):
        C.Checkpointer(tmp_path, keep_last=0)

    async def main():
        async with C.Checkpointer(tmp_path) as ck:
            with pytest.raises(ValueError):
                await ck.save(-1, {})

    run(main())


@pytest.mark.parametrize("copy_threads", [0, 1, 2])
def test_staging_paths_big_strided_and_many_chunks(tmp_path, copy_threads):
    async def main():
        g = torch.Generator().manual_seed(copy_threads)
        state = {
            "big": torch.randn(40 << 20, generator=g),  # 160 MiB: several segments and write chunks
            "strided": torch.randn(300, 200, generator=g).t(),  # torch gathers it
            "small": [torch.randn(7, generator=g) for _ in range(50)],
        }
        async with C.Checkpointer(tmp_path, copy_threads=copy_threads) as ck:
            await (await ck.save(1, state))
            assert_same({**state, "strided": state["strided"].contiguous()}, await ck.load())

    run(main())


def test_step_directory_symlinked_outside_is_rejected(tmp_path):
    async def main():
        root, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
        async with C.Checkpointer(elsewhere) as other:
            await (await other.save(1, {"v": torch.ones(2)}))
        root.mkdir()
        os.symlink(elsewhere / "step-000000001", root / "step-000000001")
        async with C.Checkpointer(root) as ck:
            with pytest.raises(dsio.errors.CheckpointFormatError):
                await ck.load(step=1)

    run(main())
