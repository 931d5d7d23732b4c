"""`OffloadAdam`: Adam(W) whose state lives off the training tensors, stepped sub-group by sub-group.

The design, in full: docs/offload.md.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from dstrain.errors import (
    ConfigError,
    EarlyStepError,
    IncompleteStepError,
    NotImplementedConfigError,
    StepThreadError,
)
from dstrain.offload.optimizer.device_stager import DeviceStager
from dstrain.offload.optimizer.early_step import KEY as EARLY_KEY
from dstrain.offload.optimizer.early_step import EarlyStep
from dstrain.offload.optimizer.statistics import OffloadOptimizerStatistics
from dstrain.offload.optimizer.step_thread import StepThread
from dstrain.offload.optimizer.sub_groups import CUT, SubGroup, master_numel, plan_sub_groups
from dstrain.offload.optimizer.swapped_state import (
    SwappedState,
    groups_state,
    load_adam_state,
    swapped_state,
    touch_order,
)
from dstrain.offload.swap.swapper import STAGING_BYTES, Swapper, SwapperStatistics, align_up

__all__ = ["CUT", "OffloadAdam", "OffloadOptimizerStatistics", "plan_sub_groups"]

log = logging.getLogger(__name__)

_F32 = 4


def _check_arguments(
    device: str,
    nvme_path: str | None,
    lr: float,
    betas: tuple[float, ...],
    eps: float,
    weight_decay: float,
    sub_group_size: int,
    buffer_count: int,
) -> None:
    """`OffloadAdam`'s arguments as torch's Adam checks its own (``ConfigError`` is a ValueError),
    naming the dstrain key each comes from."""
    if device == "nvme" and not nvme_path:
        raise ConfigError(
            "zero_optimization.offload_optimizer.nvme_path",
            "device 'nvme' needs a directory for the swap file",
        )
    for key, ok, want, got in (
        ("lr", lr >= 0, "a value >= 0", lr),
        ("betas", len(betas) == 2 and all(0 <= b < 1 for b in betas), "two values in [0, 1)", betas),
        ("eps", eps >= 0, "a value >= 0", eps),
        ("weight_decay", weight_decay >= 0, "a value >= 0", weight_decay),
    ):
        if not ok:
            raise ConfigError(f"optimizer.params.{key}", f"expected {want}, got {got!r}")
    if sub_group_size < 1:
        raise ConfigError("zero_optimization.sub_group_size", f"expected >= 1, got {sub_group_size!r}")
    if buffer_count < 1:
        raise ConfigError(
            "zero_optimization.offload_optimizer.buffer_count", f"expected >= 1, got {buffer_count!r}"
        )


class OffloadAdam(torch.optim.Optimizer):
    """Adam / AdamW (torch's fused kernel of the masters' device) over master views, state on ``device``.

    It is a ``torch.optim.Optimizer`` (``param_groups`` for LR schedules, ``state_dict`` in torch's
    own format, so checkpoints move between offload settings) and a dstrain Stepper (`prepare`,
    `statistics`, `close`).
    """

    reshapable_state = True
    """torch's state-dict format over the master views (``dstrain.checkpoint.layout.ReshapableState``)."""

    def __init__(
        self,
        params: Iterable[Any],
        *,
        device: str,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adamw: bool = True,
        sub_group_size: int = 1_000_000_000,
        nvme_path: str | None = None,
        buffer_count: int = 4,
        pinned_budget: int = 1 << 30,
        io_config: Any = None,
        master_store: Any = None,
        grad_store: Any = None,
        pin_memory: bool = False,
    ) -> None:
        if device not in ("cpu", "nvme"):
            raise ConfigError(
                "zero_optimization.offload_optimizer.device", f"expected 'cpu' or 'nvme', got {device!r}"
            )
        _check_arguments(device, nvme_path, lr, tuple(betas), eps, weight_decay, sub_group_size, buffer_count)
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        for g in self.param_groups:
            for p in g["params"]:
                if p.dtype != torch.float32:
                    raise NotImplementedConfigError(
                        "zero_optimization.offload_optimizer",
                        f"offloaded Adam steps fp32 master tensors; got {p.dtype} on {p.device}",
                    )
                if p.device != g["params"][0].device:
                    raise NotImplementedConfigError(
                        "zero_optimization.offload_optimizer",
                        f"a param group's masters are on one device; got {g['params'][0].device} and {p.device}",
                    )
        self.device = device
        self.adamw = adamw
        # gradients on NVMe (dstrain.offload.param.grads): each sub-group's range is read in the step
        self._grads = grad_store
        self._in_step = False
        # on the masters' device, like torch's fused Adam (its CUDA kernel reads the step there)
        steps = [
            torch.zeros((), dtype=torch.float32, device=g["params"][0].device if g["params"] else "cpu")
            for g in self.param_groups
        ]
        per_elem = 2 * _F32  # m and v
        numels = [master_numel(p) for g in self.param_groups for p in g["params"]]
        if device == "nvme":
            # dsio's staging pool (unused on this aligned path, but pinned) comes out of the budget too
            room = pinned_budget - STAGING_BYTES
            size, buffers = plan_sub_groups(numels, sub_group_size, room, buffer_count, per_elem)
        else:
            size, buffers = (
                max(CUT, min(align_up(sub_group_size, CUT), align_up(max(numels, default=1), CUT))),
                0,
            )
        self.sub_group_numel = size
        self._stager = DeviceStager(size)  # state -> the master's device and back (no copy on CPU)
        subs: list[SubGroup] = []
        for gi, g in enumerate(self.param_groups):
            for p in g["params"]:
                # equal pieces (multiples of CUT) rather than full ones and a sliver
                n = master_numel(p)
                pieces = -(-n // size)
                piece = align_up(-(-n // max(pieces, 1)), CUT)
                for start in range(0, n, piece):
                    subs.append(SubGroup(len(subs), gi, p, start, min(piece, n - start)))
        self._budget = pinned_budget
        swapper: Swapper | None = None
        self._closed_stats: SwapperStatistics | None = None
        if device == "nvme":
            assert nvme_path is not None  # (`_check_arguments`)
            swapper = Swapper(
                nvme_path,
                "optimizer",
                buffer_bytes=2 * align_up(size * _F32),
                buffer_count=buffers,
                io_config=io_config,
            )
            if swapper.pinned_bytes > pinned_budget:
                swapper.close()
                raise ConfigError(
                    "zero_optimization.offload_pinned_bytes",
                    f"{pinned_budget} bytes cannot hold the swap buffers plus dsio's staging pool",
                )
            for sg in subs:
                sg.offset = swapper.reserve(sg.index, 2 * align_up(sg.numel * _F32))  # m, then v
        else:
            for sg in subs:
                # offload_optimizer.pin_memory: page-locked m/v, copied to and from the GPU asynchronously
                sg.m = torch.zeros(sg.numel, dtype=torch.float32, pin_memory=pin_memory)
                sg.v = torch.zeros(sg.numel, dtype=torch.float32, pin_memory=pin_memory)
        # the state, with its reads ahead (and in the step the swapped master / gradient ranges);
        # ``master_store``: stage 3, parameters and state on NVMe, fp32: the master views have no
        # storage; each sub-group's master is read from (and written back to) the parameter file
        self.swapped = SwappedState(subs, steps, swapper, master_store, grad_store)
        if swapper is not None:
            self._initialize_files()
        self._order: list[SubGroup] = list(self.swapped.subs)  # the step's (and the reads') order
        self._stepped: set[int] = set()  # sub-groups stepped in the optimizer step under way
        self._begun = False  # the step under way has stepped its first sub-group
        self._hyper: list[tuple[Any, ...]] = []  # hyperparameters the step under way began with
        self._early: EarlyStep | None = (
            None  # stepping during backward (dstrain.offload.optimizer.early_step)
        )
        self._hold_early = False  # an async save gates the next step: no stepping during its backward
        self._thread: StepThread | None = None  # runs the early steps off the backward thread
        self._thread_failed: StepThreadError | None = None  # this step's sub-groups are not all stepped
        # sub-group -> the swap buffers of its step handed to the thread and not started yet: a failure
        # there drops them unrun (`StepThread` clears its queue), so they are handed back here
        self._queued: dict[int, tuple[Any, Any, Any]] = {}
        self._failed: BaseException | None = None  # an inline sub-group step raised: no step completes
        self._touch_pos: dict[int, int] = {}  # sub-group -> its touch set in the last touch order
        self._early_steps = 0
        self._early_s = 0.0
        self._gate: Callable[[int], float] | None = None  # an async save's wait, lent for one step
        self._step_s = 0.0
        from dstrain.offload.metrics import register_offload

        register_offload(self)  # dstrain_offload_* on dsio's metrics exporter (read at scrape time)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, while constructing only: the sub-groups and their state (m, v in host memory or
        swap slots) are planned over the groups given to the constructor, so a group added later would
        never be stepped; after construction it raises `NotImplementedConfigError`."""
        if "swapped" in self.__dict__:
            raise NotImplementedConfigError(
                "zero_optimization.offload_optimizer",
                "OffloadAdam plans its sub-groups and their state at construction: pass every param "
                "group to it (add_param_group afterwards would leave the new group's parameters unstepped)",
            )
        super().add_param_group(param_group)

    # -- swap helpers -------------------------------------------------------------------------

    def _initialize_files(self) -> None:
        """Write zeroed state for every sub-group (the file is then fully allocated)."""
        assert self.swapped.swapper is not None
        futs = []
        for sg in self.swapped.subs:
            lease = self.swapped.swapper.acquire(sg.index).result()
            lease.tensor[: 2 * align_up(sg.numel * _F32)].zero_()
            futs.append(self.swapped.swapper.store(lease))
        for f in futs:
            f.result()

    def _top_up(self) -> None:
        """Keep reads submitted for the next sub-groups of the step order not stepped yet."""
        assert self.swapped.reads is not None
        self.swapped.reads.top_up(self._order, self._stepped, self._in_step)

    # -- the Stepper surface ------------------------------------------------------------------

    def prepare(self) -> None:
        """Start reading the next step's first sub-groups (called during the boundary backward);
        with stepping during backward composed (`dstrain.offload.optimizer.early_step`), arm it."""
        self._between_steps("a second boundary backward")  # its gradient would miss stepped ones
        if self.swapped.swapper is not None:
            self._top_up()
        if self._early is not None and not self._hold_early:
            self._early.arm()
            if self.swapped.reads is not None:
                self.swapped.reads.fetch_final(set())  # the first masters, read during backward

    @property
    def steps_in_backward(self) -> bool:
        """Whether sub-groups are stepped during the boundary backward (`dstrain.offload.optimizer.early_step`)."""
        return self._early is not None

    def attach_early_step(
        self, early: EarlyStep, *, masters: int = 0, grads: int = 0, thread: StepThread | None = None
    ) -> None:
        """Let ``early`` step sub-groups during the boundary backward (`step_ready`); with the master
        or the gradients swapped, at most ``masters`` / ``grads`` of their ranges are read at once
        during backward (buffers their pools can spare then). ``thread``: run those steps there, off
        the backward thread (`dstrain.offload.optimizer.step_thread`; this optimizer closes it): the
        reads and their bookkeeping stay on the backward thread, the kernel and the write-backs of m,
        v and a swapped master (the hand-back of a swapped gradient) run there. A buffer a step on the
        thread holds is, to the pass, like one a write-back holds: a read asked for meanwhile waits in
        its pool's queue until the step (which waits for nothing of the pass) hands it back."""
        self._early = early
        self._thread = thread
        if self.swapped.reads is not None:
            self.swapped.reads.in_pass = (masters, grads)

    @property
    def sub_groups(self) -> list[SubGroup]:
        """The sub-groups, by index (`SwappedState.subs`)."""
        return self.swapped.subs

    def stepped(self, index: int) -> bool:
        """Whether sub-group ``index`` is already stepped in the optimizer step under way."""
        return index in self._stepped

    def _hyperparameters(self) -> list[tuple[Any, ...]]:
        return [(g["lr"], tuple(g["betas"]), g["eps"], g["weight_decay"]) for g in self.param_groups]

    def _begin(self) -> None:
        """Before the first sub-group of an optimizer step: count the step (the fused kernel reads
        it), forget the last step's writes."""
        if self._begun:
            return
        self._begun = True
        for st in self.swapped.steps:
            st.add_(1)
        self.swapped.stores = []
        self._hyper = self._hyperparameters()

    def _step_one(
        self, sg: SubGroup, gate: Callable[[int], float] | None, thread: StepThread | None = None
    ) -> None:
        """One Adam(W) step of ``sg``: take its state (waiting if the read is late), step, write back.
        With ``thread`` the taking is done here and the step and write-back there."""
        g = self.param_groups[sg.group]
        lease = master = swapped = None
        try:
            if self.swapped.swapper is not None:
                assert self.swapped.reads is not None
                lease, master, swapped = self.swapped.reads.take(sg)
                self._top_up()
                m, v = self.swapped.views(lease, sg)
            else:
                assert sg.m is not None and sg.v is not None
                m, v = sg.m, sg.v
            if gate is not None:  # an async save may still be reading this sub-group's bytes
                gate(self._touch_pos.get(sg.index, sg.index))
        except BaseException as e:
            # Not stepped, but the step under way is counted (`_begin`) and may have stepped others;
            # its read-ahead no longer holds this sub-group: `step` refuses from now on, as for a
            # sub-group step that failed (a re-run would find neither its reads nor its count)
            self._failed = e
            self._hand_back_unwritten(lease, master, swapped)
            raise
        if swapped is not None:  # the gradient range as read from the gradient file
            grad = swapped[1]
            p = (
                master[1]
                if master is not None
                else sg.param.detach().view(-1)[sg.start : sg.start + sg.numel]
            )
        elif master is not None:  # the fp32 master range as read from the parameter file
            p, grad = master[1], sg.grad_slice()
        else:
            p, grad = sg.slices()
        # one path for every device: state (and a swapped master) to the gradient's device,
        # stepped there by that device's fused kernel, copied back (nothing moves on a CPU run)
        beta1, beta2 = g["betas"]
        lr, wd, eps = float(g["lr"]), float(g["weight_decay"]), float(g["eps"])
        step_count = self.swapped.steps[sg.group]
        # On the step thread a CUDA gradient's step queues on the caller's stream, behind the kernels
        # that produced the gradient (the thread's own current stream would be the default one).
        stream = torch.cuda.current_stream(grad.device) if thread is not None and grad.is_cuda else None

        def run() -> None:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                _run()

        def _run() -> None:
            try:
                p_d, m_d, v_d = self._stager.to_device(grad.device, [p, m, v])
                kernel = torch._fused_adamw_ if self.adamw else torch._fused_adam_
                kernel(
                    [p_d],
                    [grad],
                    [m_d],
                    [v_d],
                    [],
                    [step_count],
                    lr=lr,
                    beta1=float(beta1),
                    beta2=float(beta2),
                    weight_decay=wd,
                    eps=eps,
                    amsgrad=False,
                    maximize=False,
                )
                self._stager.back([(p, p_d), (m, m_d), (v, v_d)])
            except BaseException:
                self._hand_back_unwritten(lease, master, swapped)  # the files keep the last step's bytes
                raise
            if swapped is not None:
                self._grads.discard(swapped[0])  # read-only: back to the pool unwritten
            if master is not None:
                self.swapped.stores.append(self.swapped.master.store_master(master[0]))  # once per step
            if lease is not None:
                assert self.swapped.swapper is not None
                self.swapped.stores.append(self.swapped.swapper.store(lease))

        self._stepped.add(sg.index)  # (before it runs: a late reduction of it is an error either way)
        if thread is None:
            try:
                run()
            except BaseException as e:  # marked stepped, maybe half-updated: `step` never completes
                self._failed = e
                raise
            return
        self._queued[sg.index] = (lease, master, swapped)

        def started() -> None:
            self._queued.pop(sg.index, None)  # from here on `_run` hands them back if it fails
            run()

        try:
            thread.submit(started)
        except StepThreadError as e:  # this one and those dropped behind the failed one never ran
            self._thread_failed = e
            self._hand_back_dropped()
            raise

    def _hand_back_dropped(self) -> None:
        """The step thread failed: the steps queued behind the failed one were dropped unrun (and no
        step runs there any more): their swap buffers go back unwritten."""
        while self._queued:
            self._hand_back_unwritten(*self._queued.popitem()[1])

    def _hand_back_unwritten(self, lease: Any, master: Any, swapped: Any) -> None:
        """A sub-group step that failed (or never ran): its swap buffers go back to their pools
        unwritten, so the pass and `close` never wait for them (best effort: the step is lost)."""
        # each on its own: one give-back that raises must not keep the others' buffers from their pools
        if swapped is not None:
            with contextlib.suppress(Exception):
                self._grads.discard(swapped[0])
        if master is not None:
            with contextlib.suppress(Exception):
                self.swapped.master.discard_master(master[0])
        if lease is not None and self.swapped.swapper is not None:
            with contextlib.suppress(Exception):
                self.swapped.swapper.discard(lease)

    @torch.no_grad()
    def step_ready(self, ready: set[int]) -> int:
        """During the boundary backward: step the sub-groups of ``ready`` (indices whose gradients
        are final) whose state is already in memory, without waiting for any read; returns how
        many were stepped. `step` steps the rest."""
        t0 = time.perf_counter()
        done = 0
        if self.swapped.reads is None:  # state in host memory: every final sub-group can step now
            for sg in self._order:
                if sg.index in ready and sg.index not in self._stepped:
                    self._begin()
                    self._step_one(sg, None, self._thread)
                    done += 1
        else:  # only those whose reads are done: backward never waits for the disk
            while True:
                self.swapped.reads.fetch_final(ready)  # their master / gradient ranges, where swapped
                if (sg_in := self.swapped.reads.read_in(ready)) is None:
                    break
                self._begin()
                self._step_one(sg_in, None, self._thread)
                done += 1
        self._early_steps += done
        self._early_s += time.perf_counter() - t0
        return done

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """One Adam(W) step of every sub-group not yet stepped during backward, in the step order,
        swapping state in and out around it."""
        if closure is not None:
            raise NotImplementedError("OffloadAdam.step takes no closure")
        t0 = time.perf_counter()
        if self._failed is not None:  # raised by a sub-group step during backward or a step() before
            raise IncompleteStepError(
                "a sub-group step of this optimizer step failed: it may be half-updated and some "
                "sub-groups were never stepped, the step can be neither finished nor re-run"
            ) from self._failed
        if self._thread is not None:
            if self._thread_failed is not None:  # raised during backward: never finish this step
                raise StepThreadError(
                    "a sub-group step of this optimizer step failed on the step thread (raised "
                    "during backward): some sub-groups were never stepped, the step cannot complete"
                ) from self._thread_failed
            try:
                self._thread.join()  # the steps handed over during backward (raises if one failed)
            except StepThreadError as e:
                self._thread_failed = e
                self._hand_back_dropped()
                raise
        gate, self._gate = self._gate, None
        if self._begun and self._hyperparameters() != self._hyper:
            raise EarlyStepError(
                f"param_groups' lr/betas/eps/weight_decay changed between backward and step, after "
                f"{len(self._stepped)} sub-group(s) were stepped during backward with the old values; "
                f"change them after step(), or set {EARLY_KEY} to false"
            )
        self._begin()
        self._in_step = True
        first: list[SubGroup] = []
        if self.swapped.reads is not None:
            # those holding master / gradient buffers read during backward go first: the reads
            # of the others may wait for those buffers (bitwise the same: sub-groups are independent)
            first = self.swapped.reads.fetched_in_pass()
            self._top_up()  # (and the master / gradient reads of the sub-groups already read ahead)
        for sg in [*first, *self._order]:
            if sg.index not in self._stepped:
                self._step_one(sg, gate)
        self._in_step = False
        self.swapped.count += 1
        self._begun = False
        self._stepped.clear()
        self._touch_pos = {}
        self._hold_early = False
        if self.swapped.reads is not None:
            self.swapped.reads.next = 0  # every sub-group was taken: the next step's reads start afresh
        if self._early is not None:
            order = self._early.finish()
            if order is not None:  # read the next step's state in the order backward finishes it
                self._order = [self.swapped.subs[i] for i in order]
        if self.swapped.reads is not None:
            self._top_up()  # next step's first reads: they run during forward/backward
        self._step_s += time.perf_counter() - t0

    def drain(self) -> None:
        """Block until every swap transfer submitted so far (reads ahead, writes behind) is done;
        the read-ahead buffers stay lent to the next step. For byte counts at a quiet point."""
        if self.swapped.swapper is not None:
            self.swapped.swapper.drain()

    def _between_steps(self, what: str) -> None:
        failed = self._failed if self._failed is not None else self._thread_failed
        if failed is not None:  # counted, maybe partly stepped: neither the last step's state nor the next's
            raise IncompleteStepError(
                f"{what} after a failed optimizer step: its state is neither that of the step before "
                "nor of the next one; load a checkpoint into a new engine to go on"
            ) from failed
        if self._stepped:
            raise EarlyStepError(
                f"{what} between backward and step: {len(self._stepped)} sub-group(s) are already "
                f"stepped during backward; call it after engine.step(), or set {EARLY_KEY} to false"
            )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: the gradients are the ZeRO strategy's buffers, zeroed by the engine after
        every step (torch's version would detach them from the master views)."""
        return None

    def _state_of(self, sgs: list[SubGroup]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of (m, v) of ``sgs``."""
        self._between_steps("reading the optimizer state")
        if self.swapped.swapper is None:
            return [(sg.m.clone(), sg.v.clone()) for sg in sgs]  # type: ignore[union-attr]
        self.swapped.cancel_ahead()
        out = []
        for sg in sgs:
            lease = self.swapped.swapper.fetch(sg.index).result()
            m, v = self.swapped.views(lease, sg)
            out.append((m.clone(), v.clone()))
            self.swapped.swapper.discard(lease).result()
        return out

    def state_dict(self) -> dict[str, Any]:
        """torch's Adam state-dict format (``exp_avg``, ``exp_avg_sq``, ``step`` per parameter),
        so a checkpoint loads into this optimizer with any offload device, or into torch's."""
        params = [p for g in self.param_groups for p in g["params"]]
        index = {id(p): i for i, p in enumerate(params)}
        state: dict[int, dict[str, torch.Tensor]] = {}
        self._between_steps("state_dict")
        if self.swapped.count:
            for sg, (m, v) in zip(self.swapped.subs, self._state_of(self.swapped.subs), strict=True):
                i = index[id(sg.param)]
                entry = state.setdefault(
                    i,
                    {
                        "step": self.swapped.steps[sg.group].clone().cpu(),
                        "exp_avg": torch.zeros(sg.shape, dtype=torch.float32),
                        "exp_avg_sq": torch.zeros(sg.shape, dtype=torch.float32),
                    },
                )
                entry["exp_avg"].view(-1)[sg.start : sg.start + sg.numel].copy_(m)
                entry["exp_avg_sq"].view(-1)[sg.start : sg.start + sg.numel].copy_(v)
        return {"state": state, "param_groups": groups_state(self.param_groups, self.adamw, index)}

    def checkpoint_state(self) -> dict[str, Any]:
        """`state_dict` for a checkpoint: with ``device="nvme"`` each ``exp_avg`` / ``exp_avg_sq`` is
        a lazy source over its slots of the swap file, streamed by the writer once this step's swap
        writes are done (`dstrain.offload.optimizer.swapped_state.swapped_state`)."""
        self._between_steps("checkpoint_state")
        if not self.swapped.streams:
            return self.state_dict()
        return swapped_state(self.swapped, self.param_groups, self.adamw)

    def checkpoint_touch_order(self) -> list[list[Any]]:
        """What the next `step` changes, per sub-group in its order (``dsio.checkpoint`` spans: the
        master range where it is in memory, the m, v slot of the swap file). The save that asks
        gates the next step, which therefore steps nothing during its backward."""
        sets = touch_order(self.swapped)  # one per sub-group, by index
        self._touch_pos = {sg.index: i for i, sg in enumerate(self._order)}
        self._hold_early = True
        return [sets[sg.index] for sg in self._order]

    def gate_next_step(self, wait: Callable[[int], float]) -> None:
        """Make the next `step` call ``wait(i)`` before it changes the bytes of touch set ``i`` of
        `checkpoint_touch_order` (an async save still streaming them: ``PendingSave.wait_captured``)."""
        self._gate = wait

    def load_checkpoint_state(self, state_dict: dict[str, Any]) -> None:
        """`load_state_dict` of a streamed load: ``exp_avg`` / ``exp_avg_sq`` may be tensors left in
        the checkpoint file (``dsio.checkpoint.StoredTensor``); each sub-group's range is read
        straight into its swap buffer (or its host m, v) and written to its slot, so the state is
        never all in memory. Each tensor is read in order, so its checksum is checked on the way
        (``dstrain.checkpoint.restore`` then checks that every byte was)."""
        self.load_state_dict(state_dict)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torch's Adam format (from this optimizer or a non-offloaded one); ``exp_avg`` and
        ``exp_avg_sq`` may also be lazy sources (`load_checkpoint_state`)."""
        self._between_steps("load_state_dict")
        load_adam_state(self.swapped, self.param_groups, state_dict)

    def statistics(self) -> OffloadOptimizerStatistics:
        sw = self.swapped.swapper.statistics() if self.swapped.swapper is not None else self._closed_stats
        return OffloadOptimizerStatistics(
            device=self.device,
            sub_groups=len(self.swapped.subs),
            sub_group_numel=self.sub_group_numel,
            steps=self.swapped.count,
            stall_seconds=self.swapped.reads.stall if self.swapped.reads is not None else 0.0,
            step_seconds=self._step_s,
            prefetch_hits=self.swapped.reads.hits if self.swapped.reads is not None else 0,
            prefetch_misses=self.swapped.reads.misses if self.swapped.reads is not None else 0,
            stepped_in_backward=self._early_steps,
            backward_step_seconds=self._early_s,
            stepped_on_thread=self._thread.jobs_done if self._thread is not None else 0,
            pinned_budget=self._budget,
            pinned_bytes=sw.pinned_bytes if sw is not None else 0,
            swapper=sw,
        )

    def close(self) -> None:
        """Finish writes in flight, free the buffers and delete the swap file."""
        from dstrain.offload.metrics import unregister_offload

        unregister_offload(self)
        if self._thread is not None:
            self._thread.close()  # a step in flight finishes first (its writes are drained below)
        if self.swapped.swapper is not None:
            try:
                self.swapped.cancel_ahead()
            finally:
                self.swapped.swapper.close()
                self._closed_stats = self.swapped.swapper.statistics()  # counters stay readable after close
                self.swapped.swapper = None

    def __del__(self) -> None:
        thread = self.__dict__.get("_thread")
        if thread is not None:  # nothing is queued there (a queued step would hold this optimizer)
            thread.stop()
        state = self.__dict__.get("swapped")  # absent when __init__ raised before making it
        sw = state.swapper if state is not None else None
        if sw is not None:
            with contextlib.suppress(Exception):  # best effort at garbage collection
                sw.close()
