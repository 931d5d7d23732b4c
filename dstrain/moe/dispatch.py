"""Moving tokens to their experts and back: buffer packing, and the all-to-all on the expert group.

Per MoE forward, on each rank of an expert-parallel group of ``ep`` ranks holding ``E / ep`` experts each::

    tokens (S, M) --pack--> (E, C, M) --all-to-all--> (ep, E/ep, C, M) --experts--> (ep, E/ep, C, M)
                 --all-to-all--> (E, C, M) --unpack (weighted by the gate)--> (S, M)

Both all-to-alls need the same ``E * C * M`` elements of the same dtype on every rank. Before the first
one the ranks *agree*: each contributes (capacity, hidden size, dtype, experts, token dropping) in one
small all-gather; every rank checks every rank's values, so a mismatch raises `ExchangeMismatchError` on
every rank at the same point instead of hanging (DeepSpeed hangs or crashes inside the all-to-all). With
``drop_tokens=False`` the agreed capacity is the largest rank's need, so ranks may hold different
numbers of tokens.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from dstrain.dist import comms_logger
from dstrain.moe.errors import ExchangeMismatchError
from dstrain.moe.gate import GateOutput

__all__ = ["ExchangeStatistics", "ExpertExchange", "pack", "unpack"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_FIELDS = ("capacity", "hidden", "dtype", "experts", "drop_tokens")


def _dtype_code(dtype: torch.dtype) -> int:
    # a stable code in every process (str hashes are salted per process)
    return _DTYPES.index(dtype) if dtype in _DTYPES else 100 + zlib.crc32(str(dtype).encode()) % 100_000


def _slots(route: GateOutput, capacity: int) -> tuple[Tensor, Tensor, Tensor]:
    """(slot in the flat (E * C) buffer, token, weight) of every kept route, routes in (k, S) order."""
    kept = route.kept  # (k, S)
    k, s = kept.shape
    slot = route.indices * capacity + route.locations  # (k, S), garbage where dropped
    token = torch.arange(s, device=slot.device).expand(k, s)
    return slot[kept], token[kept], route.weights[kept]


def pack(x: Tensor, route: GateOutput, capacity: int) -> Tensor:
    """(S, M) tokens -> (E, C, M) expert buffers; empty slots are zeros, dropped routes are not copied."""
    slot, token, _ = _slots(route, capacity)
    flat = x.new_zeros(route.num_experts * capacity, x.shape[1])
    return flat.index_copy(0, slot, x.index_select(0, token)).view(route.num_experts, capacity, x.shape[1])


def unpack(y: Tensor, route: GateOutput, capacity: int, num_tokens: int) -> Tensor:
    """(E, C, M) expert outputs -> (S, M): each token's routes summed, weighted by the combine weights.

    Products and sums are in fp32 (the weights' dtype), then cast to ``y``'s dtype.
    """
    slot, token, weight = _slots(route, capacity)
    m = y.shape[-1]
    routed = y.reshape(-1, m).index_select(0, slot).float() * weight.unsqueeze(1)  # (routes, M)
    out = routed.new_zeros(num_tokens, m).index_add(0, token, routed)
    return out.to(y.dtype)


@dataclass(frozen=True, kw_only=True, slots=True)
class ExchangeStatistics:
    """Counters of one `ExpertExchange` (bytes are what this rank sent)."""

    agreements: int
    """Agreement rounds (one per forward with ``ep > 1``)."""
    all_to_all_calls: int
    """All-to-alls issued, forward and backward."""
    all_to_all_bytes: int
    """Bytes this rank put into all-to-alls (including the share it keeps)."""
    all_to_all_seconds: float
    """Time blocked in all-to-alls."""
    agree_seconds: float
    """Time blocked in agreement rounds."""


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with equal splits whose backward is the same exchange of the gradient."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, exchange: ExpertExchange) -> Tensor:
        ctx.exchange = exchange
        return exchange._all_to_all(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return ctx.exchange._all_to_all(grad), None


class ExpertExchange:
    """The all-to-all of one MoE layer over its expert-parallel group (``group`` None: a group of one)."""

    def __init__(self, group: dist.ProcessGroup | None, size: int) -> None:
        self.group = group
        self.size = size
        self._agreements = 0
        self._calls = 0
        self._bytes = 0
        self._seconds = 0.0
        self._agree_seconds = 0.0

    def agree(
        self,
        *,
        capacity: int,
        hidden: int,
        dtype: torch.dtype,
        experts: int,
        drop_tokens: bool,
        device: torch.device | None = None,
    ) -> int:
        """The capacity every rank of the group uses for this exchange (see the module docstring).

        ``device``: where the collective's small tensor lives (the tokens' device: NCCL needs CUDA).
        Raises `ExchangeMismatchError` on every rank when the ranks disagree.
        """
        mine = (capacity, hidden, _dtype_code(dtype), experts, int(drop_tokens))
        if self.size == 1:
            return capacity
        start = time.perf_counter()
        local = torch.tensor(mine, dtype=torch.int64, device=device)
        gathered = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(gathered, local, group=self.group)
        self._agreements += 1
        self._agree_seconds += time.perf_counter() - start
        values = {r: dict(zip(_FIELDS, t.cpu().tolist(), strict=True)) for r, t in enumerate(gathered)}
        binding = ("hidden", "dtype", "experts", "drop_tokens") + (("capacity",) if drop_tokens else ())
        differ = [f for f in binding if len({v[f] for v in values.values()}) > 1]
        if differ:
            raise ExchangeMismatchError(
                f"the {self.size} ranks of the expert-parallel group disagree on {', '.join(differ)} before the "
                f"all-to-all (per rank: {values}); with drop_tokens=True every rank must route the same number of "
                "tokens (capacity follows from it), or use drop_tokens=False",
                values,
            )
        return max(v["capacity"] for v in values.values())

    def __call__(self, x: Tensor) -> Tensor:
        """Exchange equal chunks of ``x`` (dim 0 split ``size`` ways) with every rank; differentiable."""
        if self.size == 1:
            return x
        return _AllToAll.apply(x.contiguous(), self)

    def _all_to_all(self, x: Tensor) -> Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        start = time.perf_counter()
        dist.all_to_all_single(out, x, group=self.group)
        seconds = time.perf_counter() - start
        self._seconds += seconds
        self._calls += 1
        self._bytes += x.numel() * x.element_size()
        logger = comms_logger.active("all_to_all")
        if logger is not None:
            logger.record("all_to_all", x.numel() * x.element_size(), seconds, self.size)
        return out

    def statistics(self) -> ExchangeStatistics:
        """A snapshot of the counters."""
        return ExchangeStatistics(
            agreements=self._agreements,
            all_to_all_calls=self._calls,
            all_to_all_bytes=self._bytes,
            all_to_all_seconds=self._seconds,
            agree_seconds=self._agree_seconds,
        )
