"""Error-feedback 1-bit all-reduce (the communication half of 1-bit Adam), on torch.distributed.

One call averages a flat fp32 buffer over a process group while sending ~1/32 of an fp32
all-reduce, in two phases (Tang et al., "1-bit Adam", arXiv:2102.02888):

    worker:  b += worker_error;  s_w = ||b|| / sqrt(n);  worker_error = b - s_w * sign(b)
             all_to_all the packed signs (chunk r goes to rank r), all_gather the scales s_w
    server:  c = sum_r (s_w[r] / world) * sign_r[chunk];  c += server_error
             s_s = ||c|| / sqrt(n / world);  server_error = c - s_s * sign(c)
             all_gather the packed server signs and the scales s_s
    result:  chunk r of the output = s_s[r] * sign_server_r

``sign`` maps x < 0 to -1 and everything else (+0.0, -0.0, NaN) to +1, in the error feedback and in the
packed bits alike: 1 bit cannot hold 0, and -0.0 is treated as +0.0 on purpose, so the bits sent always
agree with the error that was kept (DeepSpeed 0.16.5 computed its error with this rule but packed -0.0
as -1 in its CPU packer, breaking the invariant ``buffer == scale * sign + error`` for -0.0).

Bits are packed 8 to a byte, most significant first, with torch bit operations (no cupy, no MPI): it
runs on gloo and NCCL, CPU and CUDA tensors alike. Buffers are padded (with zeros) to a multiple of
``world * lcm(world, 8)`` elements, DeepSpeed's rule, so every server chunk is whole bytes; the padding
takes part in the scales exactly as in DeepSpeed.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from dstrain.dist.comm import all_gather_single

if TYPE_CHECKING:
    from dstrain.dist.comm import Comm

__all__ = [
    "CompressedAllReduce",
    "CompressedStatistics",
    "pack_signs",
    "padded_numel",
    "sign_pm1",
    "simulate",
    "unpack_signs",
]

_SHIFTS = torch.tensor([7, 6, 5, 4, 3, 2, 1, 0], dtype=torch.uint8)


def sign_pm1(x: torch.Tensor) -> torch.Tensor:
    """+1.0 where ``x`` is not negative (including -0.0 and NaN), -1.0 where it is; fp32."""
    return torch.where(x < 0, -1.0, 1.0).to(torch.float32)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """Bit i of the result is 1 where ``x[i] >= 0`` (see `sign_pm1`); 8 per byte, MSB first; uint8."""
    n = x.numel()
    if n % 8:
        raise ValueError(f"pack_signs needs a multiple of 8 elements, got {n}")
    bits = (~(x.reshape(-1, 8) < 0)).to(torch.uint8)  # (n/8, 8)
    return (bits << _SHIFTS.to(x.device)).sum(dim=1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_signs`: +1.0 / -1.0 per bit, fp32, 8 x ``packed.numel()`` elements."""
    bits = (packed.reshape(-1, 1) >> _SHIFTS.to(packed.device)) & 1  # (n/8, 8)
    return bits.reshape(-1).to(torch.float32).mul_(2.0).sub_(1.0)


def padded_numel(numel: int, world: int) -> int:
    """``numel`` rounded up to a multiple of ``world * lcm(world, 8)`` (whole bytes per server chunk)."""
    unit = world * (world * 8 // math.gcd(world, 8))
    return -(-numel // unit) * unit


def _scale(x: torch.Tensor) -> torch.Tensor:
    # ||x|| / sqrt(n) as a 0-dim fp32 tensor (numpy's sqrt, as DeepSpeed computes it, for exact agreement)
    return torch.linalg.norm(x) / np.sqrt(x.numel())


@dataclass(frozen=True, kw_only=True, slots=True)
class CompressedStatistics:
    """Counters of one `CompressedAllReduce` (bytes this rank sent to other ranks)."""

    calls: int
    elements: int
    """Elements averaged (before padding)."""
    wire_bytes: int
    """Bytes sent to other ranks: packed signs (both phases) and scales."""
    fp32_allreduce_bytes: int
    """What a ring all-reduce of the same elements in fp32 would have sent: 2 (w-1)/w x 4 x n."""
    collective_seconds: float
    """Wall time inside the collectives (for CUDA tensors only meaningful with ``time_collectives``)."""


class CompressedAllReduce:
    """Averages flat fp32 buffers over ``group`` with 1-bit compression and error feedback.

    The caller owns the error buffers: ``worker_error`` has `padded_numel` elements, ``server_error``
    that divided by the world size; both start as zeros and persist across calls (save them per rank).
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.distributed = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size(group) if self.distributed else 1
        self.rank = dist.get_rank(group) if self.distributed else 0
        self._calls = 0
        self._elements = 0
        self._wire = 0
        self._fp32 = 0
        self._coll_s = 0.0
        self.counter: Comm | None = None
        """Where each call is also counted (`Comm.count_compressed`): the engine's data-parallel `Comm`,
        so ``engine.statistics().comm`` and the comms logger see the compressed traffic."""
        self.time_collectives = False
        """Synchronize CUDA around each collective so `collective_seconds` is exact (benchmarks only)."""

    def _collective(self, fn: Any, *args: Any) -> None:
        sync = self.time_collectives and torch.cuda.is_available() and args[0].is_cuda
        if sync:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn(*args, group=self.group)
        if sync:
            torch.cuda.synchronize()
        self._coll_s += time.perf_counter() - t

    def padded_numel(self, numel: int) -> int:
        return padded_numel(numel, self.world)

    def new_errors(self, numel: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed (worker_error, server_error) for a buffer of ``numel`` elements."""
        n = self.padded_numel(numel)
        return torch.zeros(n, device=device), torch.zeros(n // self.world, device=device)

    def all_reduce(
        self, buffer: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor
    ) -> torch.Tensor:
        """Return the compressed average of the flat fp32 ``buffer`` (left unchanged) over the group."""
        if buffer.dtype != torch.float32:
            raise TypeError(f"CompressedAllReduce averages fp32 buffers, got {buffer.dtype}")
        numel = buffer.numel()
        n = worker_error.numel()
        w = self.world
        if n != self.padded_numel(numel) or server_error.numel() != n // w:
            raise ValueError(
                f"error buffers of {n} and {server_error.numel()} elements do not fit a buffer of {numel} "
                f"elements over {w} ranks (expected {self.padded_numel(numel)} and {self.padded_numel(numel) // w})"
            )
        chunk = n // w
        coll_before = self._coll_s
        b = torch.zeros(n, dtype=torch.float32, device=buffer.device)
        b[:numel].copy_(buffer.reshape(-1))

        # worker phase: compress b + error, keep what the bits could not carry
        b.add_(worker_error)
        s_w = _scale(b)
        worker_error.copy_(b - s_w * sign_pm1(b))
        packed = pack_signs(b).reshape(w, chunk // 8)
        recv = torch.empty_like(packed)
        scales = torch.empty(w, 1, dtype=torch.float32, device=b.device)
        if w > 1:
            self._collective(dist.all_to_all_single, recv, packed)
            self._collective(all_gather_single, scales, s_w.reshape(1, 1))
        else:
            recv.copy_(packed)
            scales.copy_(s_w.reshape(1, 1))

        # server phase: average this rank's chunk of every worker, compress again with its own error
        c = unpack_signs(recv).reshape(w, chunk).mul_(scales.mul(1 / w)).sum(0)
        c.add_(server_error)
        s_s = _scale(c)
        server_error.copy_(c - s_s * sign_pm1(c))
        packed_s = pack_signs(c)
        all_signs = torch.empty(w, chunk // 8, dtype=torch.uint8, device=b.device)
        all_scales = torch.empty(w, 1, dtype=torch.float32, device=b.device)
        if w > 1:
            self._collective(all_gather_single, all_signs, packed_s.reshape(1, -1))
            self._collective(all_gather_single, all_scales, s_s.reshape(1, 1))
        else:
            all_signs.copy_(packed_s.reshape(1, -1))
            all_scales.copy_(s_s.reshape(1, 1))
        out = unpack_signs(all_signs).reshape(w, chunk).mul_(all_scales).reshape(-1)

        wire, fp32 = (w - 1) * (2 * (chunk // 8) + 2 * 4), 2 * (w - 1) * 4 * numel // w
        self._calls += 1
        self._elements += numel
        self._wire += wire
        self._fp32 += fp32
        if self.counter is not None:
            self.counter.count_compressed(wire, fp32, self._coll_s - coll_before)
        return out[:numel].reshape(buffer.shape)

    def statistics(self) -> CompressedStatistics:
        return CompressedStatistics(
            calls=self._calls,
            elements=self._elements,
            wire_bytes=self._wire,
            fp32_allreduce_bytes=self._fp32,
            collective_seconds=self._coll_s,
        )


def simulate(
    buffers: list[torch.Tensor], worker_errors: list[torch.Tensor], server_errors: list[torch.Tensor]
) -> torch.Tensor:
    """The same algorithm for ``len(buffers)`` simulated ranks in one process, with no packing and
    no communication: the reference the distributed version must equal exactly. Updates the error
    buffers in place and returns the averaged result (identical on every rank)."""
    w = len(buffers)
    numel = buffers[0].numel()
    n = worker_errors[0].numel()
    chunk = n // w
    signs, scales = [], []
    for r in range(w):
        b = torch.zeros(n, dtype=torch.float32)
        b[:numel].copy_(buffers[r].reshape(-1))
        b.add_(worker_errors[r])
        s = _scale(b)
        worker_errors[r].copy_(b - s * sign_pm1(b))
        signs.append(sign_pm1(b))
        scales.append(s)
    out_chunks = []
    for r in range(w):
        rows = torch.stack([signs[q][r * chunk : (r + 1) * chunk] for q in range(w)])
        sc = torch.stack(scales).reshape(w, 1)
        c = rows.mul_(sc.mul(1 / w)).sum(0)
        c.add_(server_errors[r])
        s = _scale(c)
        server_errors[r].copy_(c - s * sign_pm1(c))
        out_chunks.append(sign_pm1(c).mul_(s.reshape(1)))
    return torch.cat(out_chunks)[:numel].reshape(buffers[0].shape)
