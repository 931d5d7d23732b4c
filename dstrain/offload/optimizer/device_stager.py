"""`DeviceStager`: host-resident optimizer state moved to the master's device for one sub-group step.

`OffloadAdam` keeps Adam's m and v (and, with parameters on NVMe at fp32, the master itself) in
host memory or swap buffers. The fused Adam(W) kernel must run on the device of the master view and
its gradient (the same kernel the non-offloaded optimizer uses there, so results are bitwise equal):

- a tensor already on that device (everything, on a CPU run) is used in place: no copy at all;
- otherwise it is copied into a slot of a per-device scratch buffer (one slot per tensor, each as
  large as the biggest sub-group), stepped there, and copied back.

Copies are queued on the device's current stream (``non_blocking``), the kernel after them, the
copies back after the kernel, then one event is waited before the host buffers are handed to the
swap writes. The wait is per sub-group on purpose: the next sub-group's scratch reuses the same
slots, and its host buffers come from a bounded pool that the previous write must release first
(deferring the wait past the next read-ahead could deadlock a one-buffer pool). Disk reads and
writes of the other sub-groups still overlap the step; host<->device copies do not overlap the
kernel (one stream, in order).
"""

from __future__ import annotations

import torch

__all__ = ["DeviceStager"]


class DeviceStager:
    """Per-device scratch slots of ``capacity`` fp32 elements each (allocated on first use)."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._scratch: dict[torch.device, torch.Tensor] = {}
        self.copied_bytes = 0
        """Bytes copied host -> device and back (0 on a CPU run)."""

    def _slots(self, device: torch.device, count: int) -> torch.Tensor:
        buf = self._scratch.get(device)
        if buf is None or buf.numel() < count * self.capacity:
            buf = torch.empty(count * self.capacity, dtype=torch.float32, device=device)
            self._scratch[device] = buf
        return buf

    def to_device(self, device: torch.device, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each of ``tensors`` (fp32, 1-D, at most ``capacity`` elements) as a tensor on ``device``:
        itself when it is there already, else a scratch slot its values are copied into (queued on
        the current stream)."""
        away = [t for t in tensors if t.device != device]
        if not away:
            return list(tensors)
        buf = self._slots(device, len(away))
        out = []
        slot = 0
        for t in tensors:
            if t.device == device:
                out.append(t)
                continue
            if t.numel() > self.capacity:
                raise ValueError(
                    f"a sub-group of {t.numel()} elements exceeds the scratch slot ({self.capacity})"
                )
            d = buf[slot * self.capacity : slot * self.capacity + t.numel()]
            d.copy_(t, non_blocking=True)
            self.copied_bytes += t.numel() * t.element_size()
            out.append(d)
            slot += 1
        return out

    def back(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy each device tensor back into its host tensor (``(host, on_device)`` pairs; pairs that
        are the same tensor are skipped) and wait until the host tensors hold the values."""
        moved = [(h, d) for h, d in pairs if h is not d]
        if not moved:
            return
        for h, d in moved:
            h.copy_(d, non_blocking=True)
            self.copied_bytes += d.numel() * d.element_size()
        device = moved[0][1].device
        if device.type == "cuda":
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(device))
            done.synchronize()  # the host buffers are written to disk next
