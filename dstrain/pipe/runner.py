"""`PipelineRunner`: ``train_batch`` / ``eval_batch`` of one pipeline stage, from the engine's parts.

The runner executes the stage's instruction list (`dstrain.pipe.schedule`) with the engine's parts: the
ZeRO strategy's backward hooks, the precision's loss scaling, and the engine's micro-step (``engine.step``),
which reduces over the data-parallel group and steps the optimizer at the accumulation boundary. It is not
an engine and does not subclass one.

One batch, on every rank::

    1F1B steps (forward / backward, p2p with neighbours; a failure sends ABORT to them and stops)
    status all-reduce over the world: [sum of last-stage micro-batch losses, failed ranks]
        -> failure anywhere: every rank raises, no rank steps (weights stay consistent)
    wait on the sends, reduce tied gradients over the stages holding them, engine step

The returned loss is the mean over micro-batches and data-parallel ranks, on every stage.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dstrain import loop
from dstrain.pipe.errors import (
    DataExhaustedError,
    LabelMismatchError,
    PipelineAbortedError,
    PipelineError,
    PipelineLayoutError,
    ShapeMismatchError,
)
from dstrain.pipe.module import PipelineModule
from dstrain.pipe.p2p import P2PStatistics, Receiver, Sender, TensorMeta, check_grads
from dstrain.pipe.saved import SavedBytes
from dstrain.pipe.schedule import Instruction, Op, Schedule, eval_schedule, train_schedule
from dstrain.pipe.timeline import Timeline, TimelineEvent
from dstrain.pipe.transport import BACKWARD, FORWARD, Transport

__all__ = ["PipelineRunner", "PipelineStatistics", "labels_fingerprint"]

_ACT, _GRAD, _EVAL = 100, 200, 300  # tag bases of the three channel kinds
_SENDS = frozenset({Op.SEND_ACTIVATION, Op.SEND_GRAD})


def sends_first(step: tuple[Instruction, ...]) -> tuple[Instruction, ...]:
    """A step's instructions with the sends of what an earlier step produced moved ahead of its receives
    (otherwise in schedule order; a send of this step's own output stays after the compute).

    DeepSpeed's streams put a backward step's ``RecvGrad`` before its ``SendActivation`` (its sends block, so
    the order must mirror the neighbour's). Here a send only posts, so posting it first is free, and it takes
    the wait for the gradient (and its latency) off the path of the next stage, which then finds the
    activation already there when its backward ends."""
    computed = {i.micro_batch for i in step if i.op in (Op.FORWARD, Op.BACKWARD)}
    early = [i for i in step if i.op in _SENDS and i.micro_batch not in computed]
    return (*early, *(i for i in step if all(i is not e for e in early)))


def labels_fingerprint(labels: Any) -> int:
    """A 31-bit checksum of a micro-batch's labels (shape, dtype and bytes), or -1 when they are not tensors."""
    tensors = labels if isinstance(labels, (tuple, list)) else (labels,)
    if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        return -1
    crc = 0
    for t in tensors:
        crc = zlib.crc32(f"{t.dtype}{tuple(t.shape)}".encode(), crc)
        crc = zlib.crc32(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes(), crc)
    return crc & 0x7FFFFFFF


def _as_tuple(x: Any) -> tuple[torch.Tensor, ...]:
    items = x if isinstance(x, tuple) else (x,)
    for i, t in enumerate(items):
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"a stage's output must be a tensor or a tuple of tensors; item {i} is {type(t).__name__}"
            )
    return items


def _unpack(tensors: tuple[torch.Tensor, ...]) -> Any:
    return tensors[0] if len(tensors) == 1 else tensors


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineStatistics:
    """Counters and timings of one stage's runner."""

    stage: int
    stages: int
    batches: int
    micro_batches: int
    """Micro-batches run forward on this stage."""
    compute_seconds: float
    """Time in forward and backward passes (the last batch)."""
    batch_seconds: float
    """Wall time of the last batch (schedule, status, step)."""
    peak_live_activations: int
    """Most micro-batches held between forward and backward at once (1F1B: at most stages - stage)."""
    peak_activation_bytes: int
    """Largest bytes of tensors saved for backward at once (autograd saved tensors other than parameters,
    counted by a pack hook)."""
    send_activation: P2PStatistics | None
    recv_activation: P2PStatistics | None
    send_grad: P2PStatistics | None
    recv_grad: P2PStatistics | None


class PipelineRunner:
    """Runs this stage's part of every batch.

    ``engine`` provides ``zero`` (``before_backward``/``after_backward``/``loss_prescale``), ``stepper``
    (``prepare`` at the boundary backward), ``precision``
    (``scale_loss``, ``cast_inputs``), ``step()`` (one micro-step; the optimizer steps at the boundary) and
    ``is_gradient_accumulation_boundary()``. ``pp_ranks`` are the global ranks of this rank's pipeline group
    (index = stage); ``dp_size`` the data-parallel size; ``reduce_tied`` sums the tied weights' gradients over
    the stages holding them (`dstrain.pipe.grads.StageGrads.reduce_tied`), called at the boundary before the
    engine's step. Pipelines sharing a
    process group (e.g. a second model) need distinct ``channel_id``s: their messages use distinct tags.
    """

    def __init__(
        self,
        *,
        module: PipelineModule,
        engine: Any,
        micro_batches: int,
        pp_ranks: list[int],
        pp_group: Any,
        dp_size: int,
        reduce_tied: Callable[[], None] | None = None,
        p2p_timeout: float = 300.0,
        channel_id: int = 0,
        transport: Transport | None = None,
    ) -> None:
        self.module = module
        self.engine = engine
        self.micro_batches = micro_batches
        self.stage = module.stage_id
        self.stages = module.num_stages
        if len(pp_ranks) != self.stages:
            raise PipelineError(f"pipeline group has {len(pp_ranks)} ranks for {self.stages} stages")
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.dp_size = dp_size
        self._reduce_tied = reduce_tied
        self.first = self.stage == 0
        self.last = self.stage == self.stages - 1
        prev = pp_ranks[self.stage - 1] if not self.first else None
        nxt = pp_ranks[self.stage + 1] if not self.last else None

        self.transport = transport if transport is not None else Transport.gloo(pp_group)

        def ch(cls: type, peer: int | None, tag: int, direction: str, name: str) -> Any:
            if peer is None:
                return None
            return cls(
                peer=peer,
                tag=tag + 1000 * channel_id,
                transport=self.transport,
                direction=direction,
                timeout=p2p_timeout,
                name=name,
            )

        self.act_out: Sender | None = ch(Sender, nxt, _ACT, FORWARD, "activations out")
        self.act_in: Receiver | None = ch(Receiver, prev, _ACT, FORWARD, "activations in")
        self.grad_out: Sender | None = ch(Sender, prev, _GRAD, BACKWARD, "gradients out")
        self.grad_in: Receiver | None = ch(Receiver, nxt, _GRAD, BACKWARD, "gradients in")
        self.eval_out: Sender | None = ch(Sender, nxt, _EVAL, FORWARD, "eval activations out")
        self.eval_in: Receiver | None = ch(Receiver, prev, _EVAL, FORWARD, "eval activations in")
        device = next(module.parameters(), torch.empty(0)).device
        for c in (self.act_in, self.grad_in, self.eval_in):
            if c is not None:
                c.device = device  # received tensors are moved to this stage's device
        self._broken: str | None = None
        self._batches = 0
        self._micro = 0
        self._compute = 0.0
        self._batch_seconds = 0.0
        self._peak_live = 0
        self._saved = SavedBytes()
        self._peak_saved = 0
        self._timeline = Timeline()

    @property
    def trace(self) -> bool:
        """Record a per-instruction `timeline` of every batch (off by default)."""
        return self._timeline.enabled

    @trace.setter
    def trace(self, on: bool) -> None:
        self._timeline.enabled = bool(on)

    def timeline(self) -> tuple[TimelineEvent, ...]:
        """The last finished batch's instructions and end-of-batch phases with their times (needs `trace`)."""
        return self._timeline.last

    # -- public --------------------------------------------------------------------------------------

    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """One optimizer step over ``micro_batches`` micro-batches; returns the mean loss (every stage).

        The first and last stage draw ``(inputs, labels)`` from ``data_iter`` once per micro-batch.
        """
        self.module.train()
        sched = train_schedule(self.micro_batches, self.stages, self.stage)
        return self._run(sched, data_iter, train=True)

    def eval_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """Forward only (no gradients, no step); returns the mean loss over micro-batches and dp ranks."""
        self.module.eval()
        sched = eval_schedule(self.micro_batches, self.stages, self.stage)
        with torch.no_grad():
            return self._run(sched, data_iter, train=False)

    def state_dict(self) -> dict[str, Any]:
        """The pipeline layout this rank's state belongs to (a checkpoint part: checked on load)."""
        return {
            "stage": self.stage,
            "stages": self.stages,
            "parts": list(self.module.parts),
            "layers": self.module.layer_names(),
        }

    def pins_shape(self) -> bool:
        """A stage's state is its layers': not resharded to another world size or stage count."""
        return True

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Refuse a checkpoint written by another pipeline layout (stage, stage count, split or layers):
        `PipelineLayoutError`, a ``dstrain.ReshapeError``, naming both."""
        mine = self.state_dict()
        if dict(state) != mine:
            diff = [k for k in mine if state.get(k) != mine[k]]
            raise PipelineLayoutError(
                f"the checkpoint was written by another pipeline layout ({', '.join(diff)} differ): saved "
                f"{state.get('stages')} pipeline stages (this rank's stage {state.get('stage')}), this run "
                f"{mine['stages']} (stage {mine['stage']}); saved {[state.get(k) for k in diff]}, this run "
                f"{[mine[k] for k in diff]}: a pipeline stage's state is not resharded, load it with the "
                "layout it was saved with"
            )

    def statistics(self) -> PipelineStatistics:
        def st(c: Any) -> P2PStatistics | None:
            return c.statistics() if c is not None else None

        return PipelineStatistics(
            stage=self.stage,
            stages=self.stages,
            batches=self._batches,
            micro_batches=self._micro,
            compute_seconds=self._compute,
            batch_seconds=self._batch_seconds,
            peak_live_activations=self._peak_live,
            peak_activation_bytes=self._peak_saved,
            send_activation=st(self.act_out),
            recv_activation=st(self.act_in),
            send_grad=st(self.grad_out),
            recv_grad=st(self.grad_in),
        )

    # -- one batch -----------------------------------------------------------------------------------

    def _run(self, sched: Schedule, data_iter: Iterator[Any] | None, *, train: bool) -> torch.Tensor:
        if self._broken is not None:
            raise PipelineError(f"the pipeline failed earlier ({self._broken}); restart the job")
        start = time.perf_counter()
        tl = self._timeline if self._timeline.enabled else None
        if tl is not None:
            tl.begin()
        self._compute = 0.0
        m = self.micro_batches
        send_act = self.act_out if train else self.eval_out
        recv_act = self.act_in if train else self.eval_in
        if recv_act is not None:
            recv_act.expect(m)
        if train and self.grad_in is not None:
            self.grad_in.expect(m)
        state = _BatchState(sched.num_buffers)
        self._saved.exclude = {p.untyped_storage().data_ptr() for p in self.module.parameters()}
        error: BaseException | None = None
        try:
            if (self.first or self.last) and data_iter is None:
                raise PipelineError(f"stage {self.stage} loads micro-batches: train_batch needs data_iter")
            for step in sched.steps:
                for ins in sends_first(step):
                    if ins.op in (Op.REDUCE_TIED_GRADS, Op.REDUCE_GRADS, Op.OPTIMIZER_STEP):
                        continue  # after the status check below
                    t0 = time.perf_counter()
                    self._execute(ins, state, data_iter, train, send_act, recv_act)
                    if tl is not None:
                        tl.add(ins.op.value, ins.micro_batch, t0, time.perf_counter())
        except BaseException as e:  # noqa: BLE001 - every failure must reach the status all-reduce
            error = e
            origin = e if isinstance(e, PipelineAbortedError) else None
            reason = (
                str(origin)
                if origin
                else f"rank {self.rank} (stage {self.stage}) failed: {type(e).__name__}: {e}"
            )
            for c in (send_act, self.grad_out if train else None):
                if c is not None:
                    c.abort(reason)
        # every rank arrives here: [sum of its micro-batch losses (last stage), failed]
        status = torch.tensor(
            [float(sum(state.losses)) if self.last and error is None else 0.0, 1.0 if error else 0.0],
            dtype=torch.float64,
        )
        t0 = time.perf_counter()
        status = self.transport.all_reduce_status(status)  # on the transport's device (NCCL: the GPU)
        if tl is not None:
            tl.add("status", None, t0, time.perf_counter())
        if error is not None or status[1] > 0:
            self._broken = repr(error) if error is not None else "another rank failed"
            channels: list[Sender | Receiver | None] = [
                self.act_out, self.act_in, self.grad_out, self.grad_in, self.eval_out, self.eval_in
            ]  # fmt: skip
            for channel in channels:
                if channel is not None:
                    channel.forget()
            self.transport.abort()  # NCCL: unmatched sends/receives must not outlive the failed batch
            if tl is not None:
                tl.finish()
            if error is not None:
                if isinstance(error, PipelineError) or not isinstance(error, Exception):
                    raise error
                raise PipelineError(f"stage {self.stage} failed: {type(error).__name__}: {error}") from error
            raise PipelineAbortedError(
                f"{int(status[1])} rank(s) failed during this batch; no optimizer step was taken"
            )
        t0 = time.perf_counter()
        if send_act is not None:
            send_act.drain()
        if train and self.grad_out is not None:
            self.grad_out.drain()
        if tl is not None:
            tl.add("drain", None, t0, t0 := time.perf_counter())
        if train:
            if self._reduce_tied is not None:
                self._reduce_tied()
                if tl is not None:
                    tl.add("reduce_tied", None, t0, t0 := time.perf_counter())
            self.engine.step()  # the boundary micro-step: reduce over dp, unscale, clip, optimizer step
            if tl is not None:
                tl.add("step", None, t0, time.perf_counter())
                tl.finish()
        elif tl is not None:
            tl.finish()
        self._batches += 1
        self._micro += m
        self._peak_saved = max(self._peak_saved, self._saved.peak)
        self._batch_seconds = time.perf_counter() - start
        return torch.tensor(float(status[0]) / (m * self.dp_size), dtype=torch.float32)

    def _execute(
        self,
        ins: Instruction,
        state: _BatchState,
        data_iter: Iterator[Any] | None,
        train: bool,
        send_act: Sender | None,
        recv_act: Receiver | None,
    ) -> None:
        b, mb = ins.buffer_id, ins.micro_batch
        assert b is not None and mb is not None
        op = ins.op
        if op is Op.LOAD_MICRO_BATCH:
            self._load(b, mb, state, data_iter)
        elif op is Op.RECV_ACTIVATION:
            assert recv_act is not None
            r = recv_act.recv(mb)
            if train and self.grad_out is not None:
                self.grad_out.release(r.ack)
            state.inputs[b] = _unpack(r.tensors)
            state.fingerprint[b] = r.fingerprint
        elif op is Op.FORWARD:
            self._forward(b, mb, state, train)
        elif op is Op.SEND_ACTIVATION:
            assert send_act is not None
            out = _as_tuple(state.outputs[b])
            state.sent[b] = tuple(TensorMeta.of(t) for t in out)
            ack = self.grad_in.received if train and self.grad_in is not None else 0
            send_act.send(out, micro_batch=mb, ack=ack, fingerprint=state.fingerprint.get(b, -1))
            if not train:
                state.outputs.pop(b)
        elif op is Op.RECV_GRAD:
            assert self.grad_in is not None and self.act_out is not None
            r = self.grad_in.recv(mb)
            self.act_out.release(r.ack)
            check_grads(state.sent[b], r.tensors, mb, self.grad_in.peer)
            state.grads[b] = r.tensors
        elif op is Op.BACKWARD:
            self._backward(b, mb, state)
        elif op is Op.SEND_GRAD:
            assert self.grad_out is not None and self.act_in is not None
            self.grad_out.send(state.grads.pop(b), micro_batch=mb, ack=self.act_in.received)
        else:  # pragma: no cover - the schedule has no other buffer instructions
            raise PipelineError(f"unexpected instruction {ins}")

    def _load(self, b: int, mb: int, state: _BatchState, data_iter: Iterator[Any] | None) -> None:
        assert data_iter is not None
        try:
            batch = next(data_iter)
        except StopIteration:
            raise DataExhaustedError(
                f"stage {self.stage}: the data iterator ran out at micro-batch {mb} of {self.micro_batches}"
            ) from None
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise TypeError(
                f"the data iterator must yield (inputs, labels) pairs, got {type(batch).__name__}"
            )
        inputs, labels = batch
        fp = labels_fingerprint(labels)
        if self.first:
            state.inputs[b] = self.engine.precision.cast_inputs(inputs)
            state.fingerprint[b] = fp
            self._check_batch(inputs, labels, mb)
        if self.last:
            if not self.first and fp != state.fingerprint.get(b, -1) and state.fingerprint.get(b, -1) != -1:
                raise LabelMismatchError(
                    f"stage {self.stage}: the labels of micro-batch {mb} differ from those the first stage loaded "
                    "with its inputs (the stages' data iterators are out of step)"
                )
            state.labels[b] = labels

    @staticmethod
    def _check_batch(inputs: Any, labels: Any, mb: int) -> None:
        """Inputs and labels of a micro-batch must agree in their leading (batch) dimension."""
        first_in = _as_tuple(inputs)[0] if isinstance(inputs, (torch.Tensor, tuple)) else None
        if not (isinstance(first_in, torch.Tensor) and isinstance(labels, torch.Tensor)):
            return
        if first_in.dim() and labels.dim() and first_in.shape[0] != labels.shape[0]:
            raise ShapeMismatchError(
                f"micro-batch {mb}: inputs hold {first_in.shape[0]} samples, labels {labels.shape[0]}"
            )

    def _forward(self, b: int, mb: int, state: _BatchState, train: bool) -> None:
        start = time.perf_counter()
        x = state.inputs[b]
        if train:
            with torch.autograd.graph.saved_tensors_hooks(self._saved.pack, self._saved.unpack):
                out = self.module(x)
        else:
            out = self.module(x)
        if self.last:
            labels = state.labels.pop(b)
            loss_fn = self.module.loss_fn
            out = loss_fn(out, labels) if loss_fn is not None else out
            if not isinstance(out, torch.Tensor) or out.numel() != 1:
                raise ShapeMismatchError(
                    f"micro-batch {mb}: the loss must be a scalar tensor, got {out!r:.80}"
                )
            state.losses.append(out.detach().float().item())
        state.outputs[b] = out
        if train:
            state.live += 1
            self._peak_live = max(self._peak_live, state.live)
        else:
            state.inputs.pop(b, None)
            if self.last:
                state.outputs.pop(b)
        self._compute += time.perf_counter() - start

    def _backward(self, b: int, mb: int, state: _BatchState) -> None:
        start = time.perf_counter()
        engine = self.engine
        boundary = mb == self.micro_batches - 1
        out = state.outputs.pop(b)
        # the micro-step of Engine.backward (dstrain.loop): the loss on the last stage, else this
        # stage's outputs with the gradients the next stage sent for them
        loop.backward(
            out if self.last else [t for t in _as_tuple(out) if t.requires_grad],
            boundary=boundary,
            stepper=engine.stepper,
            zero=engine.zero,
            precision=engine.precision,
            accumulation_steps=self.micro_batches,
            grads=None if self.last else state.grads.pop(b),
        )
        if not boundary:
            engine.step()  # counts the micro-step (no optimizer step off the boundary)
        inputs = state.inputs.pop(b)
        if not self.first:
            state.grads[b] = tuple(
                t.grad if t.grad is not None else torch.zeros_like(t)
                for t in _as_tuple(inputs)
                if t.requires_grad
            )
        state.live -= 1
        self._compute += time.perf_counter() - start


class _BatchState:
    """Per-buffer tensors of one batch."""

    def __init__(self, num_buffers: int) -> None:
        self.num_buffers = num_buffers
        self.inputs: dict[int, Any] = {}
        self.labels: dict[int, Any] = {}
        self.outputs: dict[int, Any] = {}
        self.grads: dict[int, tuple[torch.Tensor, ...]] = {}
        self.sent: dict[int, tuple[TensorMeta, ...]] = {}
        self.fingerprint: dict[int, int] = {}
        self.losses: list[float] = []
        self.live = 0
