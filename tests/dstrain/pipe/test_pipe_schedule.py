"""The 1F1B schedule as a pure instruction list, against DeepSpeed's TrainSchedule streams (no process group)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dstrain.pipe.schedule import Instruction, Op, eval_schedule, train_schedule

HERE = Path(__file__).parent
FIXTURE = HERE / "pipe_ds_train_schedule.json"
sys.path.append(str(HERE.parents[2]))  # appended: the installed dsio stays the one imported
from bench._common import deepspeed_python  # noqa: E402  (the one way to find DeepSpeed's interpreter)

#: ``DSTRAIN_DS_PYTHON``, else the benchmarks' lookup (``DSIO_DEEPSPEED_PYTHON``, ``DSIO_DEEPSPEED_VENV``, the
#: checkout's ``.venv-deepspeed``); "" when there is none
DS_PYTHON = deepspeed_python(os.environ.get("DSTRAIN_DS_PYTHON")) or ""


def _as_ds(stages: int, micro: int, stage: int) -> dict[str, object]:
    sched = train_schedule(micro, stages, stage)
    return {
        "num_buffers": sched.num_buffers,
        "steps": [[[i.op.value, i.buffer_id] for i in step] for step in sched.steps],
    }


def _fixture() -> dict[str, object]:
    return json.loads(FIXTURE.read_text())["streams"]


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("micro", [1, 2, 4, 8])
def test_equals_deepspeed_train_schedule(stages: int, micro: int) -> None:
    """Exact instruction streams (names, buffer ids, step boundaries) of every stage, incl. micro < stages."""
    streams = _fixture()
    for stage in range(stages):
        assert _as_ds(stages, micro, stage) == streams[f"{stages},{micro},{stage}"], (stages, micro, stage)


def test_equals_deepspeed_on_every_recorded_case() -> None:
    """Also the single-stage and odd micro-batch counts recorded in the fixture."""
    streams = _fixture()
    assert len(streams) > 40
    for key, want in streams.items():
        stages, micro, stage = map(int, key.split(","))
        assert _as_ds(stages, micro, stage) == want, key


# os.access, not Path.exists: another user's venv (unreadable path) is "absent", not a collection error
@pytest.mark.skipif(
    not (DS_PYTHON and os.access(DS_PYTHON, os.X_OK)),
    reason=f"DeepSpeed's venv is not usable ({DS_PYTHON or 'none found'}) by this user: make one with "
    "bench/baselines/setup_deepspeed.sh and point DSIO_DEEPSPEED_VENV (or DSTRAIN_DS_PYTHON) at it",
)
def test_fixture_is_what_deepspeed_produces_now() -> None:
    """Re-run the recorder with DeepSpeed itself: the fixture is not stale or hand-edited."""
    out = subprocess.run(
        [DS_PYTHON, str(HERE / "pipe_record_ds_schedule.py"), "--file-only"],
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    live = json.loads(out.stdout)
    assert live["deepspeed"] == json.loads(FIXTURE.read_text())["deepspeed"]
    assert live["streams"] == _fixture()


@pytest.mark.parametrize("stages", [1, 2, 3, 5])
@pytest.mark.parametrize("micro", [1, 3, 7])
def test_invariants(stages: int, micro: int) -> None:
    """Every micro-batch is forwarded then backwarded once per stage; sends pair with the neighbour's receives."""
    scheds = [train_schedule(micro, stages, s) for s in range(stages)]
    for s, sched in enumerate(scheds):
        flat = sched.instructions()
        fwd = [i.micro_batch for i in flat if i.op is Op.FORWARD]
        bwd = [i.micro_batch for i in flat if i.op is Op.BACKWARD]
        assert fwd == list(range(micro)) and bwd == list(range(micro))
        for m in range(micro):  # 1F1B: a micro-batch's backward comes after its forward
            assert flat.index(Instruction(Op.FORWARD, m % sched.num_buffers, m)) < flat.index(
                Instruction(Op.BACKWARD, m % sched.num_buffers, m)
            )
        # in flight (forwarded, not yet backwarded) never exceeds the buffers
        live = 0
        for i in flat:
            live += (i.op is Op.FORWARD) - (i.op is Op.BACKWARD)
            assert live <= sched.num_buffers
        assert flat[-3:] == [
            Instruction(Op.REDUCE_TIED_GRADS),
            Instruction(Op.REDUCE_GRADS),
            Instruction(Op.OPTIMIZER_STEP),
        ]
        if s + 1 < stages:
            nxt = scheds[s + 1].instructions()
            sent = [i.micro_batch for i in flat if i.op is Op.SEND_ACTIVATION]
            assert sent == [i.micro_batch for i in nxt if i.op is Op.RECV_ACTIVATION] == list(range(micro))
            got = [i.micro_batch for i in flat if i.op is Op.RECV_GRAD]
            assert got == [i.micro_batch for i in nxt if i.op is Op.SEND_GRAD] == list(range(micro))
        loads = [i.micro_batch for i in flat if i.op is Op.LOAD_MICRO_BATCH]
        assert loads == (list(range(micro)) if s in (0, stages - 1) else [])
        assert len(sched.steps) == 2 * (micro + stages - 1)


def test_bubble_fraction() -> None:
    """Idle compute steps are (S - 1) / (M + S - 1) of the 2 (M + S - 1) steps on every stage."""
    for stages, micro in [(2, 4), (4, 8), (3, 1)]:
        for s in range(stages):
            steps = train_schedule(micro, stages, s).steps
            idle = sum(not any(i.op in (Op.FORWARD, Op.BACKWARD) for i in step) for step in steps)
            assert idle / len(steps) == pytest.approx((stages - 1) / (micro + stages - 1))


def test_eval_schedule() -> None:
    s0, s1, s2 = (eval_schedule(3, 3, s).instructions() for s in range(3))
    assert [i.op for i in s0[:3]] == [Op.LOAD_MICRO_BATCH, Op.FORWARD, Op.SEND_ACTIVATION]
    assert [i.op for i in s1[:3]] == [Op.RECV_ACTIVATION, Op.FORWARD, Op.SEND_ACTIVATION]
    assert [i.op for i in s2[:3]] == [Op.RECV_ACTIVATION, Op.LOAD_MICRO_BATCH, Op.FORWARD]
    assert [i.micro_batch for i in s1 if i.op is Op.FORWARD] == [0, 1, 2]


@pytest.mark.parametrize(
    ("args", "exc"),
    [
        ((0, 2, 0), ValueError),
        ((2, 0, 0), ValueError),
        ((2, 2, 2), ValueError),
        ((2, 2, -1), ValueError),
        ((2.0, 2, 0), TypeError),
        ((True, 2, 0), TypeError),
    ],
)
def test_bad_arguments(args: tuple[object, ...], exc: type[Exception]) -> None:
    with pytest.raises(exc):
        train_schedule(*args)  # type: ignore[arg-type]
    with pytest.raises(exc):
        eval_schedule(*args)  # type: ignore[arg-type]


def test_instruction_validates_buffer() -> None:
    with pytest.raises(ValueError):
        Instruction(Op.FORWARD)
    with pytest.raises(ValueError):
        Instruction(Op.OPTIMIZER_STEP, 0, 0)
    assert repr(Instruction(Op.FORWARD, 1, 3)) == "ForwardPass(buffer_id=1, micro_batch=3)"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
