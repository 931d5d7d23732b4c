"""`HostMasterShards`: ZeRO-Offload's memory at stage 3: the fp32 master and gradients in host memory.

With ``offload_optimizer.device: "cpu"`` (and parameters not offloaded), DeepSpeed keeps the fp32
master, the gradient partitions and Adam's state in host memory; the GPU holds the half-precision
shards (2 bytes a parameter) and what a step gathers. This store does the same for `Stage3Zero`, for
``"nvme"`` too (there `OffloadAdam` swaps m and v from its file; the master stays here, see
`dstrain.offload.compose.build_param_store` for why not in a file):

- the shards stay resident on the training device (the `ShardStore` default: gathers read them there);
- the fp32 master is a host tensor (page-locked where ``pin_memory`` and CUDA): `OffloadAdam`'s
  sub-groups step on the CPU beside m and v (per step only gradients and weights move);
- the gradient partitions are host tensors too (`new_master_grad`): `Stage3Zero` copies each unit's
  reduce-scattered gradient out as it arrives: the first of an accumulation window straight into the
  page-locked partition (`put_grad`: upcast on the device, one DMA, nothing done on the host), later
  ones added there (`add_grad`); `HostGradCopies` makes those copies (`OffloadedShards` uses it too);
- after the step the stepped master is cast into the device shards (`after_step`: one host-to-device
  copy of 2 bytes a parameter at bf16).

The other copies go through page-locked staging (`_Staging`, two buffers of `STAGE_BYTES`), never through
``Tensor.to`` / a cross-device ``copy_`` with a dtype change: torch converts those on the host into
pageable memory, which crossed PCIe at 1.7 GB/s on the H200 machine against 55 GB/s from page-locked
memory (bench/experiments/zero_offload_profile.py: 1.3 s of a 1.07B model's 3.0 s step was the
gradients' pageable copy-out, 0.46 s the cast back). A gradient is upcast on the device (a
`STAGE_BYTES` piece at a time) and added on the host in fp32; the master is cast on the host into
staging and copied up.

Where the training device is the host (a CPU run) nothing is separated: the store is the resident
default, the same memory and the same arithmetic. ``separate=True`` keeps the master and gradients in
tensors of their own even then (the code path of a GPU run, exercised by the CPU tests).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dstrain.dist.comm import DONE
from dstrain.zero.units import ShardStore

if TYPE_CHECKING:
    from dstrain.zero.reduce import Handle
    from dstrain.zero.units import ShardGroup

__all__ = ["PUT_BYTES", "STAGE_BYTES", "HostGradCopies", "HostMasterShards"]

HOST = torch.device("cpu")

STAGE_BYTES = 64 << 20
"""Bytes of each of the two page-locked staging buffers (and of the device-side fp32 piece a
gradient is upcast into): big enough that a copy runs at PCIe speed, small beside the model."""


PUT_BYTES = 16 << 20
"""Bytes of the device-side fp32 piece a gradient put straight into host memory is upcast into."""


class _Landed:
    """The handle of copies queued on a stream: ``wait()`` returns once they are done."""

    def __init__(self, event: torch.cuda.Event) -> None:
        self._event = event

    def wait(self) -> None:
        self._event.synchronize()


class _Staging:
    """Two page-locked byte buffers used in turn: a piece is copied through one while the other's
    copy may still be in flight (each buffer's last copy is an event waited before its next use)."""

    def __init__(self, pin: bool) -> None:
        self._bufs = [torch.empty(STAGE_BYTES, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
        self._done: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    def take(self, dtype: torch.dtype, n: int) -> tuple[torch.Tensor, int]:
        """A host tensor of ``n`` elements of ``dtype`` (at most `STAGE_BYTES`) and its slot."""
        i = self._turn
        self._turn ^= 1
        event = self._done[i]
        if event is not None:
            event.synchronize()  # its previous copy has left (or reached) the buffer
            self._done[i] = None
        return self._bufs[i].view(dtype)[:n], i

    def copied(self, slot: int) -> torch.cuda.Event:
        """The copy just queued on the current stream uses ``slot``'s buffer: its event."""
        event = torch.cuda.Event()
        event.record()
        self._done[slot] = event
        return event

    @staticmethod
    def elements(dtype: torch.dtype) -> int:
        return STAGE_BYTES // torch.empty(0, dtype=dtype).element_size()


class HostGradCopies:
    """Device gradients into host fp32 gradient partitions: the copies of `HostMasterShards` and, with
    parameters and optimizer state on NVMe on a GPU, of `dstrain.offload.param.shards.OffloadedShards`
    (one code for both). ``pin``: page-locked staging (where CUDA is)."""

    def __init__(self, pin: bool) -> None:
        self._pin = pin
        self._staging: _Staging | None = None  # made at the first staged copy

    def staging(self) -> _Staging:
        if self._staging is None:
            self._staging = _Staging(self._pin)
        return self._staging

    @property
    def pinned_bytes(self) -> int:
        """The staging buffers' page-locked bytes (0 until the first staged copy)."""
        return 2 * STAGE_BYTES if self._staging is not None and self._pin else 0

    def add(self, target: torch.Tensor, grad: torch.Tensor, alpha: float) -> None:
        """``target += alpha * grad``, ``grad`` on a device, ``target`` a host fp32 range: upcast on
        the device a piece at a time, copied into page-locked staging, added on the host in fp32
        (torch's own ``.to`` would convert on the host into pageable memory: 30x slower across PCIe)."""
        stage, step = self.staging(), _Staging.elements(torch.float32)
        pending: list[tuple[torch.Tensor, torch.Tensor, torch.cuda.Event]] = []
        for lo in range(0, grad.numel(), step):
            hi = min(grad.numel(), lo + step)
            buf, slot = stage.take(torch.float32, hi - lo)
            buf.copy_(grad[lo:hi].float(), non_blocking=True)  # (piece,) fp32 on the device, then PCIe
            event = stage.copied(slot)
            if pending:  # the previous piece has landed (or soon): add it while this one crosses
                self._add_landed(pending.pop(), alpha)
            pending.append((target[lo:hi], buf, event))
        while pending:
            self._add_landed(pending.pop(), alpha)

    def put(self, target: torch.Tensor, grad: torch.Tensor, alpha: float) -> Handle:
        """``target = alpha * grad`` (``target`` holds zeros, so it is not read), ``grad`` on a device,
        ``target`` a host fp32 range: upcast on the device a `PUT_BYTES` piece at a time and copied
        straight into the page-locked partition, a DMA the stream runs between backward's kernels: no
        staging and no work on the host. The copies are queued; the handle's ``wait()`` returns once
        they have landed. Pageable ``target`` (or a non-CUDA ``grad``): zeroed and staged (`add`)."""
        if grad.device.type != "cuda" or not target.is_pinned():  # pageable memory: staged
            target.zero_()
            self.add(target, grad, alpha)
            return DONE
        step = PUT_BYTES // 4
        for lo in range(0, grad.numel(), step):
            hi = min(grad.numel(), lo + step)
            piece = grad[lo:hi].float()  # (piece,) fp32 on the device; freed for the next one in stream order
            if alpha != 1.0:
                piece.mul_(alpha)  # the one rounding of 0 + alpha * g, as the add on the host
            target[lo:hi].copy_(piece, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(grad.device))
        return _Landed(event)

    @staticmethod
    def _add_landed(item: tuple[torch.Tensor, torch.Tensor, torch.cuda.Event], alpha: float) -> None:
        target, buf, event = item
        event.synchronize()
        target.add_(buf, alpha=alpha)


class HostMasterShards(ShardStore):
    """Resident shards, fp32 master and gradient partitions in host memory (see the module's docstring)."""

    def __init__(self, *, pin_memory: bool = True, separate: bool = False) -> None:
        self._pin = pin_memory and torch.cuda.is_available()
        self._separate = separate
        self._copies = HostGradCopies(self._pin)  # the gradients' copies out, and the cast back's staging
        self._cast_on: torch.device | None = None  # copies into these shards are queued, not waited

    @property
    def pinned_bytes(self) -> int:
        return self._copies.pinned_bytes

    def _apart(self, group: ShardGroup) -> bool:
        return self._separate or group.device.type != HOST.type

    def place(self, group: ShardGroup) -> None:
        super().place(group)  # the shards on the training device; an fp32 master aliasing them
        if not self._apart(group):
            return
        assert group.shards is not None  # set by ShardStore.place
        group.alias = False  # the master is a tensor of its own: after_step casts it into the shards
        master = torch.empty(group.total, dtype=torch.float32, device=HOST, pin_memory=self._pin)
        master.copy_(group.shards)  # (total,) fp32, upcast as ShardStore's .float() does
        group.master = master

    def new_master_grad(self, group: ShardGroup) -> torch.Tensor:
        """``group``'s fp32 gradient partition: in host memory (page-locked where CUDA is)."""
        if not self._apart(group):
            return super().new_master_grad(group)
        return torch.zeros(group.total, dtype=torch.float32, device=HOST, pin_memory=self._pin)

    def add_grad(self, target: torch.Tensor, grad: torch.Tensor, alpha: float) -> None:
        """A device gradient into its host fp32 range through page-locked staging (`HostGradCopies.add`)."""
        if target.device == grad.device:
            target.add_(grad, alpha=alpha)
            return
        self._copies.add(target, grad, alpha)

    def put_grad(self, target: torch.Tensor, grad: torch.Tensor, alpha: float) -> Handle:
        """The first gradient into a host range since it was zeroed (nothing to add it to): straight
        into the page-locked partition (`HostGradCopies.put`: one DMA between backward's kernels, no
        staging and no add on the host, which was the step's largest host cost after Adam's).
        `Stage3Zero` waits the handle before it tells anyone the range is final, after later units'
        backward has been queued."""
        if target.device == grad.device:
            return super().put_grad(target, grad, alpha)  # (a CPU run)
        return self._copies.put(target, grad, alpha)

    def after_step(self, group: ShardGroup) -> None:
        """The stepped host master cast into the device shards through page-locked staging (queued:
        `step_done` waits for the copies once, after the last group)."""
        shards = group.shards
        assert shards is not None  # set by ShardStore.place
        if not self._apart(group) or shards.device.type != "cuda":  # (a CPU run with separate=True)
            super().after_step(group)
            return
        master = group.master.detach()
        stage, step = self._copies.staging(), _Staging.elements(shards.dtype)
        for lo in range(0, group.total, step):
            hi = min(group.total, lo + step)
            buf, slot = stage.take(shards.dtype, hi - lo)
            buf.copy_(master[lo:hi])  # the cast on the host (fp32 -> bf16/fp16), into page-locked memory
            shards[lo:hi].copy_(buf, non_blocking=True)
            self._cast_on = shards.device
            stage.copied(slot)

    def step_done(self) -> None:
        """The shards are whole before another stream (a gather's) reads them: one wait per step for
        every group's copies (each staging buffer's reuse already waits for its own last copy)."""
        device, self._cast_on = self._cast_on, None
        if device is not None:
            torch.cuda.current_stream(device).synchronize()
