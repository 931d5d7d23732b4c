"""How pipeline messages travel: one `Transport` per pipeline, chosen by the process group's backend.

The p2p protocol (`dstrain.pipe.p2p`) and the schedule are the same on every backend; a transport only says

- which process group carries each direction (activations flow forward, gradients backward),
- on which device the wire tensors live (host memory on gloo, the stage's GPU on NCCL),
- whether tags keep a message's parts apart (gloo) or only their order does (NCCL ignores tags),
- how a wait is bounded by the p2p timeout, and where the batch-status all-reduce runs.

NCCL runs every send and receive between two ranks of one communicator on one CUDA stream, in the order they
were posted, so a receive posted ahead would block the sends behind it (both directions would wait for each
other). The NCCL transport therefore gives each direction a process group of its own (two communicators per
neighbour pair, two streams): on each, one rank only sends and the other only receives, and receives posted
ahead never hold back a send. Its neighbour pairs' communicators are created at construction, in pipeline
order (NCCL creates them lazily and blockingly at the first send/receive, which would deadlock against a
receive posted ahead). Receives are posted just before they are waited on, never ahead of compute
(``post_ahead``: a pending NCCL receive spins on the GPU, and CUDA's lazy kernel loading synchronizes the
device). Waits poll ``is_completed`` up to the timeout, then make the current stream wait.

``Transport.gloo_ordered`` runs that same NCCL discipline on gloo (untagged, one group per direction): the CPU
tests exercise the NCCL ordering rules with real processes. (Its waits stay gloo's: a gloo work reports
``is_completed()`` only once waited on, so the polled wait is tested on stand-in works, and on GPUs.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dstrain.dist.groups import new_group
from dstrain.pipe.errors import P2PTimeoutError, PipelineAbortedError

__all__ = ["FORWARD", "BACKWARD", "Transport"]

FORWARD, BACKWARD = "forward", "backward"
"""Directions: activations go to the next stage, gradients to the previous one."""


@dataclass(frozen=True, slots=True)
class Transport:
    """Process groups, wire device and wait discipline of one pipeline's point-to-point messages."""

    forward: Any
    """Group carrying activations (stage s -> s + 1); None: the default group."""
    backward: Any
    """Group carrying gradients (stage s -> s - 1); may be ``forward`` where tags keep directions apart."""
    device: torch.device
    """Where wire tensors (headers, payloads, receive buffers) live."""
    tagged: bool
    """True: a message's header, metadata and payload use distinct tags (gloo). False: order alone matches
    them (NCCL), every part is sent with tag 0."""
    poll: bool
    """True: waits poll ``is_completed`` up to the timeout (NCCL); False: ``wait(timeout=)`` (gloo)."""
    status_group: Any = None
    """Group of the end-of-batch status all-reduce (the world); reduced on ``device``."""
    status_device: torch.device | None = None
    """Where the status all-reduce runs when not on ``device`` (staged NCCL: the GPU, the wire is host)."""
    abort_on_failure: bool = False
    """True (NCCL): after a failed batch `abort` tears down the direction groups, whose streams may hold
    sends or receives that will never be matched (NCCL would wait for them at process exit)."""
    post_ahead: bool = True
    """True (gloo): a receiver posts the receives of its next message as soon as the previous one arrived, so
    the transfer overlaps compute. False (NCCL): it posts them when it is about to wait for them. A posted
    NCCL receive is a kernel spinning on the GPU until the peer's send arrives; any device-wide
    synchronization meanwhile waits for it: CUDA's lazy module loading (PyTorch's default) synchronizes the
    context at the first launch of every kernel, so a gradient receive posted ahead of the first forward
    deadlocked the first batch on 2x H200 (the forward waited for the gradient, which needed the forward's
    activation: rank 1 never got its first header). Receives posted just in time are only pending while
    their rank blocks on them anyway. NCCL moves the data once the receive is posted (NVLink: a 32 MiB
    activation in ~0.1 ms), so little overlap is lost."""

    # -- construction -------------------------------------------------------------------------------

    @classmethod
    def gloo(cls, group: Any = None) -> Transport:
        """Tagged messages in host memory over ``group`` (both directions)."""
        return cls(forward=group, backward=group, device=torch.device("cpu"), tagged=True, poll=False)

    @classmethod
    def staged(cls, pp_ranks: list[list[int]], mine: list[int], status_device: torch.device) -> Transport:
        """Under an NCCL world: tagged host tensors over a new gloo group of this rank's pipeline ranks (CUDA
        payloads copied to and from host memory by the p2p channels); the batch status is reduced over the
        NCCL world on ``status_device``. Collective over the world (every pipeline group, in order)."""
        group = None
        for ranks in pp_ranks:
            g = new_group(list(ranks), backend="gloo")
            if list(ranks) == list(mine):
                group = g
        return cls(
            forward=group,
            backward=group,
            device=torch.device("cpu"),
            tagged=True,
            poll=False,
            status_device=status_device,
        )

    @classmethod
    def nccl(cls, pp_ranks: list[list[int]], mine: list[int], device: torch.device) -> Transport:
        """CUDA tensors over two NCCL groups of this rank's pipeline ranks, one per direction.

        Collective over the world: ``pp_ranks`` lists every pipeline group (every rank creates every group
        in the same order); ``mine`` is this rank's. The neighbour pairs' communicators are created here.
        """
        fwd, bwd = _direction_groups(pp_ranks, mine, backend="nccl")
        t = cls(
            forward=fwd,
            backward=bwd,
            device=device,
            tagged=False,
            poll=True,
            abort_on_failure=True,
            post_ahead=False,
        )
        t.connect(mine)
        # the batch status all-reduce's communicator, created now too: NCCL builds it lazily at the first
        # collective, and its set-up (device allocations) must not meet a transfer still pending on the GPU
        dist.all_reduce(torch.zeros(1, device=device), group=t.status_group)
        return t

    @classmethod
    def gloo_ordered(cls, pp_ranks: list[list[int]], mine: list[int]) -> Transport:
        """The NCCL discipline on gloo (for tests): untagged, a group per direction, receives posted just in
        time. Waits stay gloo's ``wait(timeout=)``: a gloo send or receive reports ``is_completed()`` only once
        waited on."""
        fwd, bwd = _direction_groups(pp_ranks, mine, backend="gloo")
        t = cls(
            forward=fwd, backward=bwd, device=torch.device("cpu"), tagged=False, poll=False, post_ahead=False
        )
        t.connect(mine)
        return t

    def connect(self, mine: list[int]) -> None:
        """One blocking message between every pair of neighbours, forward then backward, in pipeline order
        (creates NCCL's lazily built pair communicators without a deadlock)."""
        if len(mine) < 2:
            return
        me = dist.get_rank()
        s = mine.index(me)
        token = torch.zeros(1, device=self.device)
        for group, order in ((self.forward, 1), (self.backward, -1)):
            src = mine[s - order] if 0 <= s - order < len(mine) else None
            dst = mine[s + order] if 0 <= s + order < len(mine) else None
            if src is not None:
                dist.recv(token, src, group=group)
            if dst is not None:
                dist.send(token, dst, group=group)

    # -- messages -----------------------------------------------------------------------------------

    def group(self, direction: str) -> Any:
        return self.forward if direction == FORWARD else self.backward

    def isend(self, t: torch.Tensor, peer: int, tag: int, direction: str) -> Any:
        return dist.isend(t, peer, group=self.group(direction), tag=tag if self.tagged else 0)

    def irecv(self, t: torch.Tensor, peer: int, tag: int, direction: str) -> Any:
        return dist.irecv(t, peer, group=self.group(direction), tag=tag if self.tagged else 0)

    def wait(self, work: Any, timeout: float, what: str) -> None:
        """Block until ``work`` completes: `P2PTimeoutError` after ``timeout`` seconds, `PipelineAbortedError`
        when the connection failed."""
        start = time.monotonic()
        if not self.poll:
            try:
                work.wait(timeout=timedelta(seconds=timeout))
            except RuntimeError as e:
                if time.monotonic() - start >= 0.9 * timeout:
                    raise P2PTimeoutError(f"{what}: nothing arrived in {timeout:g} s (p2p_timeout)") from e
                raise PipelineAbortedError(f"{what}: the connection failed ({e})") from e
            return
        pause = 0.0
        try:
            while not work.is_completed():
                if time.monotonic() - start >= timeout:
                    raise P2PTimeoutError(f"{what}: nothing arrived in {timeout:g} s (p2p_timeout)")
                if pause:
                    time.sleep(pause)
                pause = min(max(pause * 2, 1e-5), 1e-3)  # spin once, then back off to 1 ms
            work.wait()  # NCCL: the current stream waits for the transfer; gloo: raises a failure
        except RuntimeError as e:
            raise PipelineAbortedError(f"{what}: the connection failed ({e})") from e

    def abort(self) -> None:
        """After a failed batch (known on every rank): abort this transport's own direction groups (NCCL),
        so messages left unmatched by the failure never block the process; a no-op elsewhere. The pipeline
        is unusable afterwards (it already refuses further batches)."""
        if not self.abort_on_failure:
            return
        from torch.distributed import distributed_c10d as c10d

        for group in {id(g): g for g in (self.forward, self.backward) if g is not None}.values():
            try:
                c10d._abort_process_group(group)  # also forgets the group, so exit does not flush it
            except Exception:  # noqa: BLE001 - an older torch: abort the backend only
                group.abort()

    def all_reduce_status(self, status: torch.Tensor) -> torch.Tensor:
        """Sum the (CPU) batch status over the world, on this transport's device."""
        if not dist.is_initialized():
            return status
        on = status.to(self.status_device or self.device)
        dist.all_reduce(on, group=self.status_group)
        return on.cpu()


def _direction_groups(pp_ranks: list[list[int]], mine: list[int], *, backend: str) -> tuple[Any, Any]:
    """Two new groups per pipeline (forward, backward); this rank's pair. Collective over the world."""
    fwd = bwd = None
    for ranks in pp_ranks:
        f = new_group(list(ranks), backend=backend)
        b = new_group(list(ranks), backend=backend)
        if list(ranks) == list(mine):
            fwd, bwd = f, b
    return fwd, bwd
