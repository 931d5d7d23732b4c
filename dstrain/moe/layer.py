"""`MoE`: DeepSpeed's mixture-of-experts layer (same signature, defaults, module names and return value).

    moe = dstrain.moe.MoE(hidden_size=512, expert=mlp, num_experts=8, ep_size=2, k=2)
    out, l_aux, exp_counts = moe(x)          # x (..., hidden_size); add l_aux * coef to the loss

``ep_size`` ranks share the ``num_experts`` experts (``num_experts / ep_size`` each); tokens travel to
their experts by all-to-all on the expert-parallel group, which `dstrain.initialize` binds (or
`MoE.set_expert_group` for use without the engine). Expert parameters are tagged like DeepSpeed's
(``allreduce = False``, ``group_name``); the engine puts them in their own parameter groups, reduced over
the expert-data-parallel group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from dstrain.dist.comm import Comm
from dstrain.moe.dispatch import ExchangeStatistics, ExpertExchange, pack, unpack
from dstrain.moe.errors import ExpertGroupError, MoEConfigError
from dstrain.moe.experts import Experts, is_moe_param
from dstrain.moe.gate import GateOutput, TopKGate

__all__ = [
    "MOELayer",
    "MoE",
    "MoEStatistics",
    "moe_layers",
    "split_params_into_different_moe_groups_for_optimizer",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class MoEStatistics:
    """Counters of one MoE layer on this rank."""

    forward_calls: int
    tokens: int
    """Tokens routed (this rank)."""
    routes: int
    """Token-to-expert routes chosen (k per used token)."""
    dropped_routes: int
    """Routes dropped for lack of capacity."""
    capacity: int
    """Slots per expert in the last forward (agreed across the expert group)."""
    exchange: ExchangeStatistics

    @property
    def dropped_fraction(self) -> float:
        """Fraction of routes dropped since construction."""
        return self.dropped_routes / self.routes if self.routes else 0.0


class MOELayer(nn.Module):
    """Gate, pack, all-to-all, experts, all-to-all, unpack (DeepSpeed's ``deepspeed_moe`` submodule)."""

    def __init__(self, gate: TopKGate, experts: Experts, ep_size: int, num_local_experts: int) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.ep_size = ep_size
        self.num_local_experts = num_local_experts
        self.num_experts = ep_size * num_local_experts
        self.exchange: ExpertExchange | None = ExpertExchange(None, 1) if ep_size == 1 else None
        self.ep_rank = 0
        self.l_aux: Tensor | None = None
        self.exp_counts: Tensor | None = None
        self.last_route: GateOutput | None = None
        self._counts = {"forward_calls": 0, "tokens": 0, "routes": 0, "dropped_routes": 0, "capacity": 0}

    def forward(self, x: Tensor, used_token: Tensor | None = None) -> Tensor:
        if self.exchange is None:
            raise ExpertGroupError(
                f"this MoE layer has ep_size={self.ep_size} but no expert-parallel group: build the engine with "
                "dstrain.initialize (it binds the groups) or call MoE.set_expert_group(group) first"
            )
        d = x.shape[-1]
        tokens = x.reshape(-1, d)  # (S, M)
        route = self.gate(tokens, used_token)
        cap = self.exchange.agree(
            capacity=route.capacity,
            hidden=d,
            dtype=tokens.dtype,
            experts=self.num_experts,
            drop_tokens=route.drop_tokens,
            device=tokens.device,
        )
        buffers = pack(tokens, route, cap)  # (E, C, M), experts of rank r in chunk r
        buffers = self.exchange(buffers)  # chunk g: rank g's tokens for this rank's experts
        y = self.experts(buffers.view(self.ep_size, self.num_local_experts, cap, d))
        y = self.exchange(y.reshape(self.num_experts, cap, d))  # back to the tokens' ranks
        out = unpack(y, route, cap, tokens.shape[0]).reshape(x.shape)
        self.l_aux, self.exp_counts, self.last_route = route.l_aux, route.exp_counts, route
        c = self._counts
        c["forward_calls"] += 1
        c["tokens"] += tokens.shape[0]
        c["routes"] += int(route.exp_counts.sum())
        c["dropped_routes"] += route.dropped_routes()
        c["capacity"] = cap
        return out

    def statistics(self) -> MoEStatistics:
        ex = self.exchange.statistics() if self.exchange is not None else ExpertExchange(None, 1).statistics()
        return MoEStatistics(exchange=ex, **self._counts)


def _check_int(field: str, value: Any, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise MoEConfigError(field, f"must be an int >= {minimum}, got {value!r}")
    return value


class MoE(nn.Module):
    """DeepSpeed's ``deepspeed.moe.layer.MoE``; ``forward`` returns ``(output, l_aux, exp_counts)``.

    Args mirror DeepSpeed's: ``hidden_size`` (input and output width), ``expert`` (deep-copied into
    each local expert; with ``use_residual`` it is also the dense branch), ``num_experts``, ``ep_size``
    (ranks the experts are split over; must divide ``num_experts``), ``k`` (experts per token),
    ``capacity_factor`` / ``eval_capacity_factor`` (train / eval capacity), ``min_capacity``,
    ``use_residual`` (PR-MoE: output mixes the MoE and the dense expert by a learned softmax coefficient),
    ``noisy_gate_policy`` (None, 'Jitter' or 'RSample'), ``drop_tokens``, ``use_rts`` (random token
    selection), ``top2_2nd_expert_sampling`` (Gumbel noise for the second expert). See `dstrain.moe.gate`
    for the routing rules and the auxiliary loss's formula.
    """

    def __init__(
        self,
        hidden_size: int,
        expert: nn.Module,
        num_experts: int = 1,
        ep_size: int = 1,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        use_residual: bool = False,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        top2_2nd_expert_sampling: bool = True,
    ) -> None:
        super().__init__()
        _check_int("hidden_size", hidden_size, 1)
        _check_int("num_experts", num_experts, 1)
        _check_int("ep_size", ep_size, 1)
        if not isinstance(expert, nn.Module):
            raise MoEConfigError("expert", f"must be a torch.nn.Module, got {type(expert).__name__}")
        if num_experts % ep_size:
            raise MoEConfigError(
                "num_experts", f"{num_experts} experts cannot be split evenly over ep_size={ep_size} ranks"
            )
        for name, flag in (
            ("use_residual", use_residual),
            ("drop_tokens", drop_tokens),
            ("use_rts", use_rts),
            ("top2_2nd_expert_sampling", top2_2nd_expert_sampling),
        ):
            if not isinstance(flag, bool):
                raise MoEConfigError(name, f"must be a bool, got {flag!r}")
        self.ep_size = ep_size
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.use_residual = use_residual
        gate = TopKGate(
            hidden_size,
            num_experts,
            k,
            capacity_factor,
            eval_capacity_factor,
            min_capacity,
            noisy_gate_policy,
            drop_tokens,
            use_rts,
            top2_2nd_expert_sampling,
        )
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        self.deepspeed_moe = MOELayer(gate, experts, ep_size, self.num_local_experts)
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)

    @property
    def ep_rank(self) -> int:
        """This rank's index in its expert-parallel group (its experts are global ids
        ``ep_rank * num_local_experts ...``)."""
        return self.deepspeed_moe.ep_rank

    def global_expert_ids(self) -> list[int]:
        """The global ids of the experts this rank holds, in local order."""
        n = self.num_local_experts
        return list(range(self.ep_rank * n, (self.ep_rank + 1) * n))

    def set_expert_group(self, group: Any) -> None:
        """Bind the expert-parallel group: a `dstrain.dist.comm.Comm`, a ``ProcessGroup`` or None (the world).

        Its size must be ``ep_size``. `dstrain.initialize` calls this with the topology's expert group.
        """
        if isinstance(group, Comm):
            pg, size, rank = group.group, group.world_size, group.rank
        elif self.ep_size == 1 and group is None:
            pg, size, rank = None, 1, 0
        else:
            if not (dist.is_available() and dist.is_initialized()):
                raise ExpertGroupError(f"ep_size={self.ep_size} needs torch.distributed to be initialized")
            pg, size, rank = group, dist.get_world_size(group), dist.get_rank(group)
        if size != self.ep_size:
            raise ExpertGroupError(
                f"the expert-parallel group has {size} ranks, this layer's ep_size is {self.ep_size}"
            )
        self.deepspeed_moe.exchange = ExpertExchange(pg if size > 1 else None, size)
        self.deepspeed_moe.ep_rank = rank

    def forward(
        self, hidden_states: Tensor, used_token: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``hidden_states`` (..., hidden_size); ``used_token`` (tokens,) 0/1 masks tokens out of routing."""
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            dense = self.mlp(hidden_states)
            if isinstance(dense, tuple):
                dense = dense[0]
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)  # (..., 2)
            output = output * coef[..., 0:1] + dense * coef[..., 1:]
        assert self.deepspeed_moe.l_aux is not None and self.deepspeed_moe.exp_counts is not None
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts

    def statistics(self) -> MoEStatistics:
        """A snapshot of this layer's counters (routing, dropping, all-to-all bytes and time)."""
        return self.deepspeed_moe.statistics()


def moe_layers(module: nn.Module) -> list[MoE]:
    """Every `MoE` layer inside ``module``."""
    return [m for m in module.modules() if isinstance(m, MoE)]


def split_params_into_different_moe_groups_for_optimizer(
    param_groups: dict[str, Any] | list[dict[str, Any]] | tuple[dict[str, Any], ...],
) -> list[dict[str, Any]]:
    """DeepSpeed's helper: each param group split into its non-expert parameters and, per expert group
    name, a group of expert parameters marked ``"moe": True`` (same other options)."""
    groups = [param_groups] if isinstance(param_groups, dict) else list(param_groups)
    out: list[dict[str, Any]] = []
    for g in groups:
        params = list(g["params"])
        dense = [p for p in params if not is_moe_param(p)]
        out.append(dict(g, params=dense))
        by_name: dict[str, list[nn.Parameter]] = {}
        for p in params:
            if is_moe_param(p):
                by_name.setdefault(p.group_name, []).append(p)
        for name, ps in by_name.items():
            out.append(dict(g, params=ps, moe=True, name=name))
    return out
