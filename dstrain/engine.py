"""`Engine`: forward / backward / step with gradient accumulation, clipping and checkpoints.

The engine wires the parts together and owns none of their logic: the `Topology` (process groups),
`Precision` (dtype, loss scale), a `ZeroStrategy` (parameter storage, master weights, gradient
reduction), a `Stepper` (the optimizer over the master tensors), an optional `LRSchedule`, and a
`CheckpointStore`.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from dsio.metrics import untrack
from dstrain import loop
from dstrain.checkpoint.export import save_16bit_model
from dstrain.checkpoint.policy import EngineCheckpoints
from dstrain.checkpoint.state import CountersPart, Part, RngPart
from dstrain.checkpoint.store import CheckpointStore
from dstrain.config import DSConfig
from dstrain.dist.comm import CommStatistics
from dstrain.dist.topology import Topology
from dstrain.errors import DstrainError
from dstrain.optim.clip import GradSet, clip_grads_, global_grad_norm
from dstrain.optim.stepper import Stepper, WrapsOptimizer
from dstrain.precision import Precision
from dstrain.scheduler import LRSchedule
from dstrain.zero.base import GathersModule, ZeroStatistics, ZeroStrategy

__all__ = ["Engine", "EngineStatistics", "StepObserver"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineStatistics:
    """Counters and cumulative timings of one rank's engine."""

    global_steps: int
    """Optimizer steps attempted (including skipped ones), as in DeepSpeed."""
    micro_steps: int
    skipped_steps: int
    """Steps skipped because fp16 gradients overflowed."""
    loss_scale: float
    last_grad_norm: float
    """Global gradient norm of the last step (nan when neither clipping nor fp16 needed it)."""
    samples: int
    """Micro-batch samples this rank processed (counted when the first input tensor has a batch dim)."""
    forward_seconds: float
    backward_seconds: float
    step_seconds: float
    """Time in `Engine.step` at accumulation boundaries: reduction, unscale, optimizer, gather."""
    last_step_seconds: float
    """Wall time between the last two optimizer steps."""
    checkpoint_blocked_seconds: float = 0.0
    """Time checkpoint saves held training: inside `Engine.save_checkpoint`, plus, for an
    ``async_save``, the wait at the next step for staging still unfinished."""
    comm: CommStatistics
    zero: ZeroStatistics
    last_loss: float = float("nan")
    """Mean over the last optimizer step's micro-steps of the losses given to `Engine.backward` (this rank);
    with ``scale_wrt_gas=False`` the losses given are already divided by the accumulation steps, so
    their sum is that mean."""
    lr: tuple[float, ...] = ()
    """Learning rate of each param group."""
    tokens: int = 0
    """Tokens this rank processed: the elements of the first input when it is an integer tensor (token
    ids, ``(B, T)``), else its batch dimension (samples)."""
    last_step_tokens: int = 0
    """Tokens of the last optimizer step's micro-batches."""
    tokens_per_second: float = 0.0
    """``last_step_tokens / last_step_seconds`` (0 before two steps were timed)."""
    model_flops_per_step: float = float("nan")
    """This rank's model FLOPs per optimizer step, as measured by the flops profiler (`dstrain.profiling`);
    nan until it ran."""
    mfu: float = float("nan")
    """Model FLOPs utilisation of the last step: ``model_flops_per_step / last_step_seconds / peak``
    (the profiler's given or measured peak FLOP/s); nan without the profiler."""


@runtime_checkable
class StepObserver(Protocol):
    """A part told after every optimizer step (the monitors of `dstrain.monitor`, the flops profiler)."""

    def after_step(self, engine: Engine) -> None: ...

    def close(self) -> None: ...


class Engine:
    """What `dstrain.initialize` returns first; call it like the model."""

    def __init__(
        self,
        *,
        module: torch.nn.Module,
        config: DSConfig,
        topology: Topology,
        precision: Precision,
        zero: ZeroStrategy,
        stepper: Stepper,
        lr_scheduler: LRSchedule | None,
        store: CheckpointStore,
        parts: Mapping[str, Part] | None = None,
        grad_sets: Callable[[], list[GradSet]] | None = None,
        runner: Callable[[Engine], Any] | None = None,
    ) -> None:
        """``parts``: the rooms' own checkpoint parts (e.g. MoE's expert layout). ``grad_sets``: what
        the global gradient norm is computed over (default: ZeRO's sets; a pipeline stage's are summed
        over every stage). ``runner``: builds, over this engine, what runs whole batches (`train_batch`
        / `eval_batch`: a pipeline model's `dstrain.pipe.PipelineRunner`)."""
        self._closed = False
        self.module = module
        self.config = config
        self.topology = topology
        self.comm = topology.dp  # batches are split, and gradients averaged, over the data-parallel group
        self.precision = precision
        self.zero = zero
        self.stepper = stepper
        self.lr_scheduler = lr_scheduler
        self.global_steps = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self._grad_norm = float("nan")
        self.grad_sets: Callable[[], list[GradSet]] = grad_sets if grad_sets is not None else zero.grad_sets
        """What the global gradient norm (clipping, fp16's overflow check) is computed over: ZeRO's sets, or
        a pipeline stage's sets summed over every stage (tied weights counted once)."""
        self._samples = 0
        self._times = {"forward": 0.0, "backward": 0.0, "step": 0.0}
        self._last_step_end: float | None = None
        self._last_step_seconds = 0.0
        # the step's mean loss, summed on the device (no sync per micro-step)
        self._loss_sum: torch.Tensor | None = None
        self._last_loss: torch.Tensor | None = None
        self._tokens = self._step_tokens = self._last_step_tokens = 0
        self.observers: list[StepObserver] = []
        """Parts `initialize` composes in that act after each optimizer step (monitors, profiler)."""
        self.model_flops_per_step: float | None = None
        """Set by the flops profiler: this rank's model FLOPs per optimizer step."""
        self.peak_flops: float | None = None
        """Set by the flops profiler: the peak FLOP/s MFU is measured against."""
        self._extra_parts = dict(parts or {})
        self.checkpoints = EngineCheckpoints(
            self,
            store,
            parts=self.checkpoint_parts,
            world=topology.world,
            dp=self.comm,
            stage=zero.stage,
            tag_validation=config.checkpoint.tag_validation,
            node_local=config.checkpoint.use_node_local_storage,
        )
        """The checkpoint policy (`dstrain.checkpoint.policy`); ``checkpoints.pending``: a save in flight."""
        self._boundary: bool | None = None  # set_gradient_accumulation_boundary's override
        self._no_sync = False
        self._step_applied = False
        self.runner: Any = runner(self) if runner is not None else None
        """What runs whole batches (`train_batch` / `eval_batch`): a `dstrain.pipe.PipelineRunner` for a
        pipeline model; None otherwise (train with forward/backward/step)."""

    # -- training ----------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the module; floating-point inputs are cast to the compute dtype (fp16/bf16)."""
        start = time.perf_counter()
        args = self.precision.cast_inputs(args)
        kwargs = self.precision.cast_inputs(kwargs)
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if first is not None and first.dim() > 0:
            self._samples += first.shape[0]
            self._step_tokens += first.numel() if not first.is_floating_point() else first.shape[0]
        out = self.module(*args, **kwargs)
        self._times["forward"] += time.perf_counter() - start
        return out

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the next `step` will update the weights: every ``gradient_accumulation_steps``-th
        micro-step, or what `set_gradient_accumulation_boundary` said; never inside `no_sync`."""
        if self._no_sync:
            return False
        if self._boundary is not None:
            return self._boundary
        return (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of ``loss`` x loss scale / accumulation steps; gradients accumulate over micro-steps.

        Returns ``loss / gradient_accumulation_steps``, as DeepSpeed does. ``scale_wrt_gas=False``
        (DeepSpeed's argument): the caller already divided the loss (HF's Trainer does)."""
        gas = self.config.gradient_accumulation_steps if scale_wrt_gas else 1
        start = time.perf_counter()
        loop.backward(
            loss,
            boundary=self.is_gradient_accumulation_boundary(),
            stepper=self.stepper,
            zero=self.zero,
            precision=self.precision,
            accumulation_steps=gas,
        )
        # this micro-step's share of the step's mean loss: a loss the caller divided already
        # (scale_wrt_gas=False) is its share as it is
        done = loss.detach().float()
        if scale_wrt_gas:
            done = done / self.config.gradient_accumulation_steps
        self._loss_sum = done if self._loss_sum is None else self._loss_sum + done
        self._times["backward"] += time.perf_counter() - start
        return loss / gas

    def step(self) -> None:
        """At an accumulation boundary: reduce, unscale, check overflow, clip, update; always count the micro-step."""
        if self._no_sync:
            raise DstrainError(
                "engine.step() inside engine.no_sync(): step after leaving it (as DeepSpeed requires)"
            )
        self._step_applied = False
        if self.is_gradient_accumulation_boundary():
            start = time.perf_counter()
            self.zero.reduce_gradients()
            overflow = self._unscale_and_clip()
            # an async save may still be reading what the step changes: a stepper that steps piece
            # by piece waits for each piece; everything else waits for the whole staging
            self._staging_fence(lend=not overflow)
            self._step_applied = not overflow
            if self.optimizer is not None:  # DeepSpeed's optimizer.overflow, read by integrations
                self.optimizer.overflow = overflow
            if overflow:
                self.skipped_steps += 1
            else:
                self.stepper.step()
                if self.lr_scheduler is not None:
                    self.lr_scheduler.step()
            self._staging_fence()  # before ZeRO rewrites the parameters
            self.zero.after_step(stepped=not overflow)
            self.zero.zero_grad()
            self.global_steps += 1
            end = time.perf_counter()
            self._times["step"] += end - start
            if self._last_step_end is not None:
                self._last_step_seconds = end - self._last_step_end
            self._last_step_end = end
            if self._loss_sum is not None:
                self._last_loss = self._loss_sum
            self._loss_sum = None
            self._tokens += self._step_tokens
            self._last_step_tokens, self._step_tokens = self._step_tokens, 0
            self._report(overflow)
            for observer in self.observers:
                observer.after_step(self)
        self.micro_steps += 1

    def train_batch(self, data_iter: Any = None) -> torch.Tensor:
        """One optimizer step over ``gradient_accumulation_steps`` micro-batches drawn from ``data_iter``
        (``(inputs, labels)`` pairs); returns the mean loss. Pipeline models only (DeepSpeed's API)."""
        if self.runner is None:
            raise DstrainError(
                "train_batch needs a pipeline model (dstrain.pipe.PipelineModule); use forward/backward/step"
            )
        return self.runner.train_batch(data_iter)

    def eval_batch(self, data_iter: Any = None) -> torch.Tensor:
        """Forward ``gradient_accumulation_steps`` micro-batches without gradients; the mean loss."""
        if self.runner is None:
            raise DstrainError("eval_batch needs a pipeline model (dstrain.pipe.PipelineModule)")
        return self.runner.eval_batch(data_iter)

    def _unscale_and_clip(self) -> bool:
        """Unscale the master gradients, compute their global norm where needed (clipping, or fp16's
        overflow check), clip; returns True when the step must be skipped (a non-finite norm)."""
        self.precision.unscale_(self.zero.master_grads())
        clip = self.config.gradient_clipping
        if not (clip > 0 or self.precision.checks_overflow):
            self._grad_norm = float("nan")
            return False
        # with fp16 every rank (every stage, too) must agree to skip or take the step
        agree = self.topology.world if self.precision.checks_overflow else None
        self._grad_norm = global_grad_norm(self.grad_sets(), agree=agree)
        overflow = not math.isfinite(self._grad_norm)
        self.precision.update(overflow)
        if not overflow:
            clip_grads_(self.zero.master_grads(), clip, self._grad_norm)
        return overflow

    def _report(self, overflow: bool) -> None:
        if self.comm.rank != 0 or self.global_steps % self.config.steps_per_print:
            return
        log.info(
            "step=%d skipped=%d lr=%s loss_scale=%g grad_norm=%.4g%s",
            self.global_steps,
            self.skipped_steps,
            self.get_lr(),
            self.precision.loss_scale,
            self._grad_norm,
            " (overflow)" if overflow else "",
        )
        if self.config.wall_clock_breakdown:
            t = self._times
            log.info("time: forward=%.3fs backward=%.3fs step=%.3fs", t["forward"], t["backward"], t["step"])

    # -- accessors DeepSpeed users call ---------------------------------------------------------

    @property
    def optimizer(self) -> Any:
        """What `dstrain.initialize` returned as the optimizer: the torch optimizer behind a
        `TorchStepper`, else the stepper itself (both have ``param_groups``)."""
        return self.stepper.optimizer if isinstance(self.stepper, WrapsOptimizer) else self.stepper

    def get_lr(self) -> list[float]:
        """Current learning rate of each param group."""
        return [float(g["lr"]) for g in self.stepper.param_groups]

    @property
    def loss_scale(self) -> float:
        """Current loss scale (1.0 unless fp16)."""
        return self.precision.loss_scale

    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        return self.train(False)

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def zero_optimization_stage(self) -> int:
        return self.zero.stage

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state as detached CPU copies, on every rank (a collective at stage 3).

        At stage 3 ``module.state_dict()`` holds released parameters; this gathers them first.
        """
        partitioned = isinstance(self.zero, GathersModule)
        if isinstance(self.zero, GathersModule):
            self.zero.gathered_module()
        try:
            return {k: v.detach().cpu().clone() for k, v in self.module.state_dict().items()}
        finally:
            if partitioned and isinstance(self.zero, GathersModule):
                self.zero.release_all()

    def statistics(self) -> EngineStatistics:
        """A snapshot of counters and timings."""
        step_s, flops, peak = self._last_step_seconds, self.model_flops_per_step, self.peak_flops
        return EngineStatistics(
            global_steps=self.global_steps,
            micro_steps=self.micro_steps,
            skipped_steps=self.skipped_steps,
            loss_scale=self.precision.loss_scale,
            last_grad_norm=self._grad_norm,
            samples=self._samples,
            forward_seconds=self._times["forward"],
            backward_seconds=self._times["backward"],
            step_seconds=self._times["step"],
            last_step_seconds=self._last_step_seconds,
            checkpoint_blocked_seconds=self.checkpoints.blocked_seconds,
            comm=self.comm.statistics(),
            zero=self.zero.statistics(),
            last_loss=float(self._last_loss) if self._last_loss is not None else float("nan"),
            lr=tuple(self.get_lr()),
            tokens=self._tokens,
            last_step_tokens=self._last_step_tokens,
            tokens_per_second=self._last_step_tokens / step_s if step_s > 0 else 0.0,
            model_flops_per_step=flops if flops is not None else float("nan"),
            mfu=flops / step_s / peak if flops is not None and peak and step_s > 0 else float("nan"),
        )

    # -- checkpoints (the policy is dstrain.checkpoint.policy's) ---------------------------------

    @property
    def store(self) -> CheckpointStore:
        """Where checkpoints go (`dstrain.checkpoint.store`)."""
        return self.checkpoints.store

    @store.setter
    def store(self, store: CheckpointStore) -> None:
        self.checkpoints.store = store

    def checkpoint_parts(self) -> dict[str, Part | None]:
        """The parts that save and restore their own state, by checkpoint key (see dstrain.checkpoint.state);
        the rooms' own parts (``parts=``, e.g. MoE's expert layout) first: they check before anything loads."""
        return {
            **self._extra_parts,
            "engine": CountersPart(self),
            "zero": self.zero,
            "stepper": self.stepper,
            "precision": self.precision,
            "lr_scheduler": self.lr_scheduler,
            "rng": RngPart(),
            "pipeline": self.runner,  # a pipeline's layout, checked on load (None without one)
        }

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """DeepSpeed's: whether `save_16bit_model` gathers stage-3 weights (the config key)."""
        return self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save

    def save_16bit_model(
        self,
        save_dir: str | os.PathLike[str],
        save_filename: str = "model.safetensors",
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """DeepSpeed's: the whole model in its compute dtype as one safetensors file on rank 0 (a
        collective: call it on every rank), gathered a unit at a time at stage 3. At stage 3 without
        ``zero_optimization.stage3_gather_16bit_weights_on_model_save`` it saves nothing and returns
        False (use `dstrain.checkpoint.export` on a checkpoint instead)."""
        if self.zero.stage == 3 and not self.zero_gather_16bit_weights_on_model_save():
            log.warning(
                "save_16bit_model saved nothing: stage 3 needs zero_optimization."
                "stage3_gather_16bit_weights_on_model_save: true (or export a checkpoint: dstrain export)"
            )
            return False
        save_16bit_model(
            self.module,
            self.zero,
            self.topology.world.rank,
            save_dir,
            save_filename,
            exclude_frozen_parameters=exclude_frozen_parameters,
        )
        return True

    def save_checkpoint(
        self,
        save_dir: str | os.PathLike[str],
        tag: str | None = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
        async_save: bool = False,
        exclude_frozen_parameters: bool = False,
    ) -> Path:
        """Every rank saves its partitions, optimizer state and counters; returns this rank's file.

        ``save_dir`` is a dsio checkpoint directory (``step-<N>/`` per save, ``latest``): with the
        default tag (``global_step<N>``) the save is step ``global_steps`` of ``save_dir``; a named tag
        (or ``save_latest=False``) saves into ``save_dir/<tag>/``. With ``async_save`` the call returns
        once the state is captured and the files are written while training goes on; the save commits
        at `wait_checkpoint`, or at the next `save_checkpoint`, `load_checkpoint` or `close` (all
        collective: call them on every rank). ``exclude_frozen_parameters`` (DeepSpeed's): parameters
        with ``requires_grad=False`` are not saved (the model being loaded into has them already).
        """
        return self.checkpoints.save(
            save_dir, tag, client_state, save_latest, async_save, exclude_frozen=exclude_frozen_parameters
        )

    def _staging_fence(self, lend: bool = False) -> None:
        self.checkpoints.fence(lend)

    def wait_checkpoint(self) -> Path | None:
        """Finish an asynchronous save (a collective); returns its file, or None when none was pending."""
        return self.checkpoints.wait()

    def load_checkpoint(
        self,
        load_dir: str | os.PathLike[str],
        tag: str | None = None,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_strict: bool = True,
    ) -> tuple[Path, dict[str, Any]]:
        """Restore what `save_checkpoint` wrote; returns (path, client_state). A checkpoint saved at
        another world size, ZeRO stage or offload device is resharded for this engine
        (`dstrain.checkpoint.reshape`), optimizer state included.

        ``tag`` None loads ``load_dir``'s latest step (rank 0's choice, on every rank); a tag that names
        a directory ``load_dir/<tag>`` loads that directory's latest; ``global_step<N>`` loads step N of
        ``load_dir``. DeepSpeed's flags: ``load_optimizer_states`` / ``load_lr_scheduler_states`` False
        keep this engine's optimizer / schedule; ``load_module_strict`` False accepts a checkpoint that
        lacks some of the model's parameters or holds others (those left as they are; the shared ones
        must still have the same shapes), where True raises `CheckpointMismatchError` naming them.
        """
        return self.checkpoints.load(
            load_dir,
            tag,
            load_optimizer_states=load_optimizer_states,
            load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_strict=load_module_strict,
        )

    # -- DeepSpeed's engine API (what HF Trainer, Accelerate and DeepSpeed's tests call) -------------

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Say whether the next `step` is an accumulation boundary (DeepSpeed: for callers that count
        micro-steps themselves); `is_gradient_accumulation_boundary` returns it until changed again."""
        if not isinstance(is_boundary, bool):
            raise TypeError(f"is_boundary must be a bool, got {type(is_boundary).__name__}")
        self._boundary = is_boundary

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without reducing them (DeepSpeed's semantics): ZeRO stages 0-1 only,
        no `step` inside, no re-entry."""
        if self.zero.stage >= 2:
            raise DstrainError(
                f"no_sync is incompatible with ZeRO stage {self.zero.stage}: it partitions (reduce-scatters) "
                "gradients in every backward"
            )
        if self._no_sync:
            raise DstrainError("no_sync does not nest")
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = False

    def was_step_applied(self) -> bool:
        """Whether the last `step` updated the weights (False for a micro-step that was not a boundary,
        and for a step skipped because fp16 gradients overflowed)."""
        return self._step_applied

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm of the last optimizer step; None where it was not computed (no
        clipping and no fp16; DeepSpeed returns None when its norm is off)."""
        return None if math.isnan(self._grad_norm) else self._grad_norm

    def gradient_clipping(self) -> float:
        """``gradient_clipping`` from the config (0: off)."""
        return self.config.gradient_clipping

    @property
    def device(self) -> torch.device:
        """Where the module computes (this rank's GPU under NCCL, else the CPU)."""
        for t in itertools.chain(self.module.parameters(), self.module.buffers()):
            return t.device
        return torch.device("cpu")

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]:
        """The module's parameters (at stage 3, released ones are empty between uses)."""
        return self.module.parameters(recurse)

    def named_parameters(
        self, prefix: str = "", recurse: bool = True
    ) -> Iterator[tuple[str, torch.nn.Parameter]]:
        return self.module.named_parameters(prefix, recurse)

    def is_first_stage(self) -> bool:
        """This rank runs the first pipeline stage (always, without a pipeline)."""
        return self.topology.pp.rank == 0

    def is_last_stage(self) -> bool:
        """This rank runs the last pipeline stage (always, without a pipeline)."""
        return self.topology.pp.rank == self.topology.pp.world_size - 1

    def empty_partition_cache(self) -> None:
        """Release every gathered stage-3 parameter (DeepSpeed's name); nothing to do below stage 3."""
        if isinstance(self.zero, GathersModule):
            self.zero.release_all()

    def destroy(self) -> None:
        """DeepSpeed's name for `close`."""
        self.close()

    # -- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        """Finish a pending asynchronous save, remove the ZeRO strategy's hooks (the model keeps its weights).

        Idempotent. An engine still open at exit is closed then (dstrain.dist.lifetime), before the
        process groups are destroyed."""
        if self._closed:
            return
        self._closed = True
        untrack(self)  # its dstrain_* series (dstrain.metrics.register) leave the next scrape
        self.checkpoints.close()  # finishes a pending save, releases the directories' writer locks
        for observer in self.observers:  # monitors flush and close their files
            observer.close()
        self.observers.clear()
        self.stepper.close()
        self.zero.close()

    @property
    def closed(self) -> bool:
        """Whether `close` ran."""
        return self._closed

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
