"""1F1B (PipeDream-flush) as a pure instruction list: no process group, no tensors, only what each stage does.

Stage ``s`` of ``S`` runs ``2 * (M + S - 1)`` steps for ``M`` micro-batches. In step ``t`` a stage either runs a
forward (when ``t - s`` is even) or a backward (when it is odd):

- the forward of micro-batch ``m`` on stage ``s`` happens at step ``2 m + s``: one step after the previous stage
  ran it, so its activation has just been sent;
- the backward of ``m`` happens at step ``2 m + 2 S - 1 - s``: one step after the next stage ran it.

A step whose micro-batch index falls outside ``[0, M)`` is idle (the fill and drain of the pipeline: the
bubble, ``(S - 1) / (M + S - 1)`` of the steps). Around the compute each step exchanges what the previous step
produced: a forward step first returns the gradient of the previous backward to the previous stage and receives
its input activation; a backward step receives its output gradient and sends the activation of the previous
forward. The last step reduces tied and data-parallel gradients and steps the optimizer.

Activations live in ``num_buffers`` cyclic buffers (micro-batch ``m`` uses ``m % num_buffers``): a stage
holds at most ``S - s`` micro-batches between their forward and backward.

The instruction stream (names and buffer ids) equals DeepSpeed's ``TrainSchedule`` for every stage and
micro-batch count, which `tests/dstrain/pipe/test_pipe_schedule.py` checks; unlike it, each instruction also
names its micro-batch, which the runner uses to check that what arrives is what was expected.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Instruction", "Op", "Schedule", "eval_schedule", "train_schedule"]


class Op(enum.Enum):
    """What one instruction does (values are DeepSpeed's instruction class names)."""

    LOAD_MICRO_BATCH = "LoadMicroBatch"
    """Take the next ``(inputs, labels)`` from the data iterator (first and last stage only)."""
    FORWARD = "ForwardPass"
    BACKWARD = "BackwardPass"
    SEND_ACTIVATION = "SendActivation"
    RECV_ACTIVATION = "RecvActivation"
    SEND_GRAD = "SendGrad"
    RECV_GRAD = "RecvGrad"
    REDUCE_TIED_GRADS = "ReduceTiedGrads"
    REDUCE_GRADS = "ReduceGrads"
    OPTIMIZER_STEP = "OptimizerStep"


_BUFFERED = frozenset(Op) - {Op.REDUCE_TIED_GRADS, Op.REDUCE_GRADS, Op.OPTIMIZER_STEP}


@dataclass(frozen=True, slots=True)
class Instruction:
    """One instruction: ``op`` on activation buffer ``buffer_id`` for micro-batch ``micro_batch``.

    ``buffer_id`` and ``micro_batch`` are None for the end-of-batch instructions (reductions, step).
    """

    op: Op
    buffer_id: int | None = None
    micro_batch: int | None = None

    def __post_init__(self) -> None:
        if (self.op in _BUFFERED) != (self.buffer_id is not None):
            raise ValueError(
                f"Instruction {self.op.value}: buffer_id is required exactly for buffer operations"
            )

    def __repr__(self) -> str:
        if self.buffer_id is None:
            return f"{self.op.value}()"
        return f"{self.op.value}(buffer_id={self.buffer_id}, micro_batch={self.micro_batch})"


@dataclass(frozen=True, slots=True)
class Schedule:
    """The instruction steps of one stage for one batch, and how many activation buffers it needs."""

    micro_batches: int
    stages: int
    stage: int
    num_buffers: int
    steps: tuple[tuple[Instruction, ...], ...]
    """One tuple per step; an idle step is an empty tuple."""

    def instructions(self) -> list[Instruction]:
        """Every instruction in order, steps flattened."""
        return [ins for step in self.steps for ins in step]


def _check(micro_batches: int, stages: int, stage: int) -> None:
    for name, value in (("micro_batches", micro_batches), ("stages", stages), ("stage", stage)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
    if stages < 1:
        raise ValueError(f"stages must be >= 1, got {stages}")
    if not 0 <= stage < stages:
        raise ValueError(f"stage must be in [0, {stages}), got {stage}")


def train_num_buffers(micro_batches: int, stages: int, stage: int) -> int:
    """Activation buffers stage ``stage`` needs: its most forwards awaiting their backward (at least 2)."""
    return max(2, min(stages - stage, micro_batches))


def train_schedule(micro_batches: int, stages: int, stage: int) -> Schedule:
    """The 1F1B instruction steps of ``stage`` (0-based) for one training batch of ``micro_batches``."""
    _check(micro_batches, stages, stage)
    n_buf = train_num_buffers(micro_batches, stages, stage)
    has_prev, has_next = stage > 0, stage < stages - 1
    loads = stage == 0 or stage == stages - 1
    total = 2 * (micro_batches + stages - 1)

    def mb_at(t: int) -> tuple[int, bool]:
        """(micro-batch, is_forward) of step ``t``; the micro-batch may lie outside [0, M): idle."""
        if (t - stage) % 2 == 0:
            return (t - stage) // 2, True
        return (t + stage + 1) // 2 - stages, False

    def valid(m: int) -> bool:
        return 0 <= m < micro_batches

    def ins(op: Op, m: int) -> Instruction:
        return Instruction(op, m % n_buf, m)

    steps: list[tuple[Instruction, ...]] = []
    prev = -1  # the micro-batch of the previous step (idle at the start)
    for t in range(total):
        m, forward = mb_at(t)
        cmds: list[Instruction] = []
        if forward:
            if has_prev and valid(prev):
                cmds.append(ins(Op.SEND_GRAD, prev))  # the gradient the previous (backward) step produced
            if has_prev and valid(m):
                cmds.append(ins(Op.RECV_ACTIVATION, m))
        else:
            if has_next and valid(m):
                cmds.append(ins(Op.RECV_GRAD, m))
            if has_next and valid(prev):
                cmds.append(ins(Op.SEND_ACTIVATION, prev))  # the output the previous (forward) step produced
        if loads and forward and valid(m):
            cmds.append(ins(Op.LOAD_MICRO_BATCH, m))
        if valid(m):
            cmds.append(ins(Op.FORWARD if forward else Op.BACKWARD, m))
        if t == total - 1:
            cmds += [
                Instruction(Op.REDUCE_TIED_GRADS),
                Instruction(Op.REDUCE_GRADS),
                Instruction(Op.OPTIMIZER_STEP),
            ]
        steps.append(tuple(cmds))
        prev = m
    return Schedule(micro_batches, stages, stage, n_buf, tuple(steps))


def eval_schedule(micro_batches: int, stages: int, stage: int) -> Schedule:
    """Forward-only steps of ``stage``: per micro-batch receive (or load), forward, send; two buffers.

    A stage's forward of micro-batch ``m`` only waits for the previous stage's forward of ``m``; receives are
    posted ahead by the runner, so stages overlap without the lock-step of a training schedule.
    """
    _check(micro_batches, stages, stage)
    first, last = stage == 0, stage == stages - 1
    steps = []
    for m in range(micro_batches):
        b = m % 2
        cmds = []
        if not first:
            cmds.append(Instruction(Op.RECV_ACTIVATION, b, m))
        if first or last:
            cmds.append(Instruction(Op.LOAD_MICRO_BATCH, b, m))
        cmds.append(Instruction(Op.FORWARD, b, m))
        if not last:
            cmds.append(Instruction(Op.SEND_ACTIVATION, b, m))
        steps.append(tuple(cmds))
    return Schedule(micro_batches, stages, stage, 2, tuple(steps))
