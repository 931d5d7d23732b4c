"""`OffloadAdam`: Adam(W) whose state lives off the training tensors, stepped sub-group by sub-group.

The ZeRO strategy hands over its fp32 master views (each with ``.grad`` viewing the reduced fp32
gradient). Each view is cut into sub-groups of at most ``sub_group_numel`` elements, a multiple of
1024 from the view's start: torch's fused CPU kernel is vectorised from a tensor's start, so cuts
at such multiples give bit-for-bit the same arithmetic as stepping the whole view (checked by the
parity tests against the non-offloaded optimizer).

Where the state lives:

- ``device="cpu"``: Adam's m and v per sub-group in host memory; nothing to swap.
- ``device="nvme"``: m and v per sub-group in one swap file (`Swapper`). During `step`, sub-group
  ``i`` is stepped while the next ones are read and the previous ones written; at the end of
  `step` the reads of the next step's first sub-groups are submitted, so they run (after the
  writes drain, which need no gradients) during the next forward and backward. The training
  thread waits only when a read is truly late; that wait is `stall_seconds`.

The fp32 master itself is the ZeRO strategy's tensor: at fp32 it *is* the model's parameter
storage, so swapping it would only add a second copy of bytes already in memory (except with
parameters on NVMe too, where the master is the shard in the parameter file, `master_store`).

The masters (and their gradients) may live on any device, CUDA included. The state is kept on the
host or NVMe either way; each sub-group's m, v (and a swapped master) are moved to the gradient's
device by a `DeviceStager`, stepped there by that device's fused Adam(W) (the kernel the
non-offloaded optimizer uses, elementwise, so sub-group slicing keeps results bitwise equal), and
copied back before their swap write. On a CPU run nothing moves: the same code, no copies.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from dstrain.errors import ConfigError, NotImplementedConfigError
from dstrain.offload.device_copy import DeviceStager
from dstrain.offload.optimizer_state import (
    groups_state,
    load_adam_state,
    swapped_state,
    touch_order,
)
from dstrain.offload.sub_groups import CUT, SubGroup, plan_sub_groups
from dstrain.offload.swapper import STAGING_BYTES, Lease, Swapper, SwapperStatistics, align_up

__all__ = ["CUT", "OffloadAdam", "OffloadOptimizerStatistics", "plan_sub_groups"]

log = logging.getLogger(__name__)

_F32 = 4


@dataclass(frozen=True, slots=True)
class OffloadOptimizerStatistics:
    """Swap and stall counters of one rank's offloaded optimizer."""

    device: str
    sub_groups: int
    sub_group_numel: int
    steps: int
    stall_seconds: float
    """Training-thread time spent waiting for swapped-in state that was not there yet."""
    step_seconds: float
    """Time inside `OffloadAdam.step` (the stalls included)."""
    prefetch_hits: int
    """Sub-groups whose state was already in memory when the step reached them."""
    prefetch_misses: int
    pinned_budget: int
    pinned_bytes: int
    """Pinned bytes allocated for this optimizer's swapping (never above ``pinned_budget``)."""
    swapper: SwapperStatistics | None


class OffloadAdam(torch.optim.Optimizer):
    """Adam / AdamW (torch's fused kernel of the masters' device) over master views, state on ``device``.

    It is a ``torch.optim.Optimizer`` (``param_groups`` for LR schedules, ``state_dict`` in torch's
    own format, so checkpoints move between offload settings) and a dstrain Stepper (`prepare`,
    `statistics`, `close`).
    """

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
    ) -> None:
        if device not in ("cpu", "nvme"):
            raise ConfigError(
                "zero_optimization.offload_optimizer.device", f"expected 'cpu' or 'nvme', got {device!r}"
            )
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
        # stage 3, parameters and state on NVMe, fp32: the master views have no storage; each
        # sub-group's master is read from (and written back to) the parameter shard file
        self._master = master_store
        # gradients on NVMe (dstrain.offload.grad_store): each sub-group's range is read in the step
        self._grads = grad_store
        self._in_step = False
        # on the masters' device, like torch's fused Adam (its CUDA kernel reads the step there)
        self._steps = [
            torch.zeros((), dtype=torch.float32, device=g["params"][0].device if g["params"] else "cpu")
            for g in self.param_groups
        ]
        per_elem = 2 * _F32  # m and v
        numels = [p.numel() for g in self.param_groups for p in g["params"]]
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
        self._subs: list[SubGroup] = []
        for gi, g in enumerate(self.param_groups):
            for p in g["params"]:
                # equal pieces (multiples of CUT) rather than full ones and a sliver
                pieces = -(-p.numel() // size)
                piece = align_up(-(-p.numel() // max(pieces, 1)), CUT)
                for start in range(0, p.numel(), piece):
                    self._subs.append(SubGroup(len(self._subs), gi, p, start, min(piece, p.numel() - start)))
        self._budget = pinned_budget
        self._swapper: Swapper | None = None
        self._closed_stats: SwapperStatistics | None = None
        if device == "nvme":
            assert nvme_path is not None
            self._swapper = Swapper(
                nvme_path,
                "optimizer",
                buffer_bytes=2 * align_up(size * _F32),
                buffer_count=buffers,
                io_config=io_config,
            )
            if self._swapper.pinned_bytes > pinned_budget:
                self._swapper.close()
                raise ConfigError(
                    "zero_optimization.offload_pinned_bytes",
                    f"{pinned_budget} bytes cannot hold the swap buffers plus dsio's staging pool",
                )
            for sg in self._subs:
                sg.offset = self._swapper.reserve(sg.index, 2 * align_up(sg.numel * _F32))  # m, then v
            self._initialize_files()
        else:
            for sg in self._subs:
                sg.m = torch.zeros(sg.numel, dtype=torch.float32)
                sg.v = torch.zeros(sg.numel, dtype=torch.float32)
        self._ahead: deque[list[Any]] = deque()  # [sub-group, state lease future, master future]
        self._stores: list[concurrent.futures.Future[None]] = []  # the last step's writes
        self._gate: Callable[[int], float] | None = None  # an async save's wait, lent for one step
        self._stall = self._step_s = 0.0
        self._hits = self._misses = 0
        self._count = 0
        from dstrain.offload.metrics import register_offload

        register_offload(self)  # dstrain_offload_* on dsio's metrics exporter (read at scrape time)

    # -- swap helpers -------------------------------------------------------------------------

    def _views(self, lease: Lease, sg: SubGroup) -> tuple[torch.Tensor, torch.Tensor]:
        v_at = align_up(sg.numel * _F32)
        return lease.view(torch.float32, 0, sg.numel), lease.view(torch.float32, v_at, sg.numel)

    def _initialize_files(self) -> None:
        """Write zeroed state for every sub-group (the file is then fully allocated)."""
        assert self._swapper is not None
        futs = []
        for sg in self._subs:
            lease = self._swapper.acquire(sg.index).result()
            lease.tensor[: 2 * align_up(sg.numel * _F32)].zero_()
            futs.append(self._swapper.store(lease))
        for f in futs:
            f.result()

    @property
    def _lookahead(self) -> int:
        return self._swapper._buffers if self._swapper is not None else 0

    def _top_up(self, order: list[SubGroup], pos: int) -> None:
        """Keep reads submitted for the sub-groups after ``pos`` (as many as there are buffers)."""
        assert self._swapper is not None
        queued = {entry[0].index for entry in self._ahead}
        nxt = pos + len(self._ahead)
        while len(self._ahead) < self._lookahead and nxt < len(order):
            sg = order[nxt]
            if sg.index not in queued:
                self._ahead.append([sg, self._swapper.fetch(sg.index), None, None])
            nxt += 1
        if self._grads is not None and self._in_step:  # gradients are final only once the step runs
            for entry in self._ahead:
                if entry[3] is None:
                    entry[3] = self._grads.fetch(entry[0].group, entry[0].master_start, entry[0].numel)
        if self._master is not None and self._in_step:
            # master reads only inside the step: during forward/backward the parameter pool
            # belongs to the shard reads of the gathers
            for entry in self._ahead:
                if entry[2] is None:
                    sg = entry[0]
                    entry[2] = self._master.fetch_master(sg.group, sg.master_start, sg.numel)

    def _take(self, sg: SubGroup) -> tuple[Lease, Any, Any]:
        """The sub-group's state lease, its (master lease, master view) when the master is swapped,
        and its (gradient lease, gradient view) when the gradients are."""
        if not self._ahead or self._ahead[0][0] is not sg:
            raise RuntimeError("offload read-ahead out of order")  # a bug, never user input
        _, fut, mfut, gfut = self._ahead.popleft()
        if gfut is not None:
            self._grads.took(gfut)
        futs = [f for f in (fut, mfut, gfut) if f is not None]
        if all(f.done() for f in futs):
            self._hits += 1
        else:
            self._misses += 1
            t0 = time.perf_counter()
            concurrent.futures.wait(futs)
            self._stall += time.perf_counter() - t0
        return (
            fut.result(),
            mfut.result() if mfut is not None else None,
            gfut.result() if gfut is not None else None,
        )

    # -- the Stepper surface ------------------------------------------------------------------

    def prepare(self) -> None:
        """Start reading the next step's first sub-groups (called during the boundary backward)."""
        if self._swapper is not None and not self._ahead:
            self._top_up(self._subs, 0)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """One Adam(W) step of every sub-group, in order, swapping state in and out around it."""
        if closure is not None:
            raise NotImplementedError("OffloadAdam.step takes no closure")
        t0 = time.perf_counter()
        for st in self._steps:
            st.add_(1)
        kernel = torch._fused_adamw_ if self.adamw else torch._fused_adam_
        gate, self._gate = self._gate, None
        self._in_step = True
        if self._swapper is not None:
            self.prepare()
            self._top_up(self._subs, 0)  # master reads of the sub-groups already read ahead
        self._stores = []
        for pos, sg in enumerate(self._subs):
            g = self.param_groups[sg.group]
            lease = master = swapped = None
            if self._swapper is not None:
                lease, master, swapped = self._take(sg)
                self._top_up(self._subs, pos + 1)
                m, v = self._views(lease, sg)
            else:
                assert sg.m is not None and sg.v is not None
                m, v = sg.m, sg.v
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
            if gate is not None:  # an async save may still be reading this sub-group's bytes
                gate(pos)
            p_d, m_d, v_d = self._stager.to_device(grad.device, [p, m, v])
            beta1, beta2 = g["betas"]
            kernel(
                [p_d],
                [grad],
                [m_d],
                [v_d],
                [],
                [self._steps[sg.group]],
                lr=float(g["lr"]),
                beta1=float(beta1),
                beta2=float(beta2),
                weight_decay=float(g["weight_decay"]),
                eps=float(g["eps"]),
                amsgrad=False,
                maximize=False,
            )
            self._stager.back([(p, p_d), (m, m_d), (v, v_d)])
            if swapped is not None:
                self._grads.discard(swapped[0])  # read-only: back to the pool unwritten
            if master is not None:
                self._stores.append(self._master.store_master(master[0]))  # written once per step
            if lease is not None:
                assert self._swapper is not None
                self._stores.append(self._swapper.store(lease))
        self._in_step = False
        self._count += 1
        if self._swapper is not None:
            self._top_up(self._subs, 0)  # next step's first reads: they run during forward/backward
        self._step_s += time.perf_counter() - t0

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: the gradients are the ZeRO strategy's buffers, zeroed by the engine after
        every step (torch's version would detach them from the master views)."""
        return None

    def _cancel_ahead(self) -> None:
        """Hand back read-ahead buffers unused (before state is replaced or read another way)."""
        assert self._swapper is not None
        while self._ahead:
            _, fut, mfut, gfut = self._ahead.popleft()
            self._swapper.discard(fut.result())
            if mfut is not None:
                self._master.discard_master(mfut.result()[0])
            if gfut is not None:
                self._grads.discard(gfut.result()[0])
        self._swapper.drain()

    def _state_of(self, sgs: list[SubGroup]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of (m, v) of ``sgs``."""
        if self._swapper is None:
            return [(sg.m.clone(), sg.v.clone()) for sg in sgs]  # type: ignore[union-attr]
        self._cancel_ahead()
        out = []
        for sg in sgs:
            lease = self._swapper.fetch(sg.index).result()
            m, v = self._views(lease, sg)
            out.append((m.clone(), v.clone()))
            self._swapper.discard(lease).result()
        return out

    def state_dict(self) -> dict[str, Any]:
        """torch's Adam state-dict format (``exp_avg``, ``exp_avg_sq``, ``step`` per parameter),
        so a checkpoint loads into this optimizer with any offload device, or into torch's."""
        params = [p for g in self.param_groups for p in g["params"]]
        index = {id(p): i for i, p in enumerate(params)}
        state: dict[int, dict[str, torch.Tensor]] = {}
        if self._count:
            for sg, (m, v) in zip(self._subs, self._state_of(self._subs), strict=True):
                i = index[id(sg.param)]
                entry = state.setdefault(
                    i,
                    {
                        "step": self._steps[sg.group].clone().cpu(),
                        "exp_avg": torch.zeros(sg.param.shape, dtype=torch.float32),
                        "exp_avg_sq": torch.zeros(sg.param.shape, dtype=torch.float32),
                    },
                )
                entry["exp_avg"].view(-1)[sg.start : sg.start + sg.numel].copy_(m)
                entry["exp_avg_sq"].view(-1)[sg.start : sg.start + sg.numel].copy_(v)
        return {"state": state, "param_groups": self._groups_state(index)}

    def checkpoint_state(self) -> dict[str, Any]:
        """`state_dict` for a checkpoint: with ``device="nvme"`` each ``exp_avg`` / ``exp_avg_sq`` is
        a lazy source over its slots of the swap file, streamed by the writer once this step's swap
        writes are done (`dstrain.offload.optimizer_state.swapped_state`)."""
        return swapped_state(self)

    def checkpoint_touch_order(self) -> list[list[Any]]:
        """What the next `step` changes, per sub-group in its order (``dsio.checkpoint`` spans: the
        master range where it is in memory, the m, v slot of the swap file)."""
        return touch_order(self)

    def gate_next_step(self, wait: Callable[[int], float]) -> None:
        """Make the next `step` call ``wait(i)`` before it changes the bytes of touch set ``i`` of
        `checkpoint_touch_order` (an async save still streaming them: ``PendingSave.wait_captured``)."""
        self._gate = wait

    def _groups_state(self, index: dict[int, int]) -> list[dict[str, Any]]:
        return groups_state(self, index)

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
        load_adam_state(self, state_dict)

    def statistics(self) -> OffloadOptimizerStatistics:
        sw = self._swapper.statistics() if self._swapper is not None else self._closed_stats
        return OffloadOptimizerStatistics(
            device=self.device,
            sub_groups=len(self._subs),
            sub_group_numel=self.sub_group_numel,
            steps=self._count,
            stall_seconds=self._stall,
            step_seconds=self._step_s,
            prefetch_hits=self._hits,
            prefetch_misses=self._misses,
            pinned_budget=self._budget,
            pinned_bytes=sw.pinned_bytes if sw is not None else 0,
            swapper=sw,
        )

    def close(self) -> None:
        """Finish writes in flight, free the buffers and delete the swap file."""
        from dstrain.offload.metrics import unregister_offload

        unregister_offload(self)
        if self._swapper is not None:
            try:
                self._cancel_ahead()
            finally:
                self._swapper.close()
                self._closed_stats = self._swapper.statistics()  # counters stay readable after close
                self._swapper = None

    def __del__(self) -> None:
        sw = getattr(self, "_swapper", None)
        if sw is not None:
            with contextlib.suppress(Exception):  # best effort at garbage collection
                sw.close()
