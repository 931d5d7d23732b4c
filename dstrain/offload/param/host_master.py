"""`HostMasterShards`: ZeRO-Offload's memory at stage 3: the fp32 master and gradients in host memory.

With ``offload_optimizer.device: "cpu"`` (and parameters not offloaded), DeepSpeed keeps the fp32
master, the gradient partitions and Adam's state in host memory; the GPU holds the half-precision
shards (2 bytes a parameter) and what a step gathers. This store does the same for `Stage3Zero`:

- the shards stay resident on the training device (the `ShardStore` default: gathers read them there);
- the fp32 master is a host tensor (page-locked where ``pin_memory`` and CUDA), so `OffloadAdam`'s
  sub-groups step on the CPU with its m, v beside them (nothing moves per step but gradients and
  weights);
- the gradient partitions are host tensors too (`new_master_grad`): `Stage3Zero` copies each unit's
  reduce-scattered gradient out as it arrives and adds it there;
- after the step the stepped master is cast into the device shards (`after_step`: one host-to-device
  copy of 2 bytes a parameter at bf16).

Where the training device is the host (a CPU run) nothing is separated: the store is the resident
default, the same memory and the same arithmetic. ``separate=True`` keeps the master and gradients in
tensors of their own even then (the code path of a GPU run, exercised by the CPU tests).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dstrain.zero.units import ShardStore

if TYPE_CHECKING:
    from dstrain.zero.units import ShardGroup

__all__ = ["HostMasterShards"]

HOST = torch.device("cpu")


class HostMasterShards(ShardStore):
    """Resident shards, fp32 master and gradient partitions in host memory (see the module's docstring)."""

    def __init__(self, *, pin_memory: bool = True, separate: bool = False) -> None:
        self._pin = pin_memory and torch.cuda.is_available()
        self._separate = separate

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
