"""Routing: which expert each token goes to, where in that expert's buffer, with what weight.

The design, in full: docs/moe.md.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dstrain.moe.errors import MoEConfigError

__all__ = ["GateOutput", "TopKGate", "capacity", "top1_gating", "top2_gating", "topk_gating"]

_log = logging.getLogger(__name__)

NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")


def capacity(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int, k: int = 1) -> int:
    """Per-expert buffer size: ``max(ceil(num_tokens / num_experts * capacity_factor * k), min_capacity)``.

    The product is evaluated in float32 (``float32(S / E) * float32(capacity_factor * k)``) so that the
    result is bit-for-bit DeepSpeed's, including where float32 rounding lands just above an integer.
    """
    per_expert = torch.tensor(num_tokens / num_experts, dtype=torch.float32)
    factor = torch.tensor(capacity_factor * k, dtype=torch.float32)
    return max(int(torch.ceil(per_expert * factor).item()), int(min_capacity))


@dataclass(frozen=True, slots=True)
class GateOutput:
    """One gating decision over ``S`` tokens, as ``k`` routes per token.

    Route ``j`` of token ``s`` goes to expert ``indices[j, s]`` at slot ``locations[j, s]`` of that expert's
    buffer with combine weight ``weights[j, s]``; a dropped route has index -1, location 0 and weight 0.
    """

    l_aux: Tensor
    """The load-balancing loss (0-dim, fp32, differentiable through the router probabilities)."""
    capacity: int
    """Slots per expert this rank needs: the configured capacity when dropping, else the largest count."""
    indices: Tensor
    """(k, S) int64 expert of each route, -1 where the route was dropped."""
    locations: Tensor
    """(k, S) int64 slot in the expert's buffer, 0 where dropped."""
    weights: Tensor
    """(k, S) fp32 combine weight of each route (differentiable), 0 where dropped."""
    exp_counts: Tensor
    """(E,) int64 routes each expert was chosen for, counted before capacity dropping (DeepSpeed's)."""
    num_experts: int
    drop_tokens: bool
    """Whether ``capacity`` is binding (True) or only the local need (False: agreed upward later)."""

    @property
    def kept(self) -> Tensor:
        """(k, S) bool: routes that survived the capacity limit."""
        return self.indices >= 0

    def dropped_routes(self) -> int:
        """Routes chosen but dropped for lack of capacity (tokens, for top-1)."""
        return int(self.exp_counts.sum().item()) - int(self.kept.sum().item())

    def combine_weights(self, capacity: int | None = None) -> Tensor:
        """Dense (S, E, C) combine tensor (DeepSpeed's ``combine_weights``); C defaults to ``capacity``."""
        c = self.capacity if capacity is None else capacity
        k, s = self.indices.shape
        out = self.weights.new_zeros(s * self.num_experts * c)
        slot = (
            torch.arange(s, device=self.indices.device).expand(k, s) * self.num_experts
            + self.indices.clamp(min=0)
        ) * c + self.locations
        out = out.index_add(0, slot[self.kept], self.weights[self.kept])
        return out.view(s, self.num_experts, c)

    def dispatch_mask(self, capacity: int | None = None) -> Tensor:
        """Dense (S, E, C) bool dispatch mask (DeepSpeed's ``dispatch_mask``: nonzero combine weights)."""
        return self.combine_weights(capacity).bool()


def _mean_load(gates: Tensor, chosen: Tensor) -> Tensor:
    """me * ce per expert (see the module docstring)."""
    return torch.mean(gates, dim=0) * torch.mean(chosen.float(), dim=0)


def _uniform_like(t: Tensor) -> Tensor:
    return torch.rand(t.shape, dtype=torch.float32, device=t.device)


def _gumbel_like(t: Tensor) -> Tensor:
    # Gumbel(0, 1) = -log(-log(U)), U ~ Uniform(0, 1); U bounded away from 0 and 1 so both logs are finite
    u = torch.rand(t.shape, dtype=t.dtype, device=t.device)
    tiny = torch.finfo(t.dtype).tiny
    return -torch.log(-torch.log(u.clamp(min=tiny, max=1.0 - torch.finfo(t.dtype).eps)))


def _apply_used(mask: Tensor, used_token: Tensor | None) -> Tensor:
    if used_token is None:
        return mask
    return mask * used_token.reshape(-1, 1).to(mask.dtype)


def top1_gating(
    logits: Tensor,
    capacity_factor: float,
    min_capacity: int,
    *,
    used_token: Tensor | None = None,
    rsample: bool = False,
    drop_tokens: bool = True,
    use_rts: bool = True,
) -> GateOutput:
    """Switch routing of (S, E) fp32 ``logits``; see the module docstring for the rule and ``l_aux``."""
    s, e = logits.shape
    gates = F.softmax(logits, dim=1)  # (S, E)
    choice_scores = logits + _gumbel_like(logits) if rsample else gates
    first = torch.argmax(choice_scores, dim=1)  # (S,)
    mask = _apply_used(F.one_hot(first, num_classes=e), used_token)  # (S, E) int64
    exp_counts = mask.sum(dim=0).detach()
    l_aux = torch.sum(_mean_load(gates, mask)) * e
    if drop_tokens:
        cap = capacity(s, e, capacity_factor, min_capacity)
        # priority per (token, expert): random under RTS, else the 0/1 mask itself (torch.topk's tie order)
        priority = mask * _uniform_like(mask) if use_rts else mask
        keep = torch.topk(priority, k=min(cap, s), dim=0)[1]  # (min(C, S), E) token ids
        mask = mask * torch.zeros_like(mask).scatter_(0, keep, 1)
    else:
        cap = int(exp_counts.max().item()) if s else 0
    locations = torch.cumsum(mask, dim=0) - 1  # (S, E) slot of each token in its expert's buffer
    kept = mask.sum(dim=1) > 0  # (S,)
    indices = torch.where(kept, first, torch.full_like(first, -1))
    loc = torch.sum(locations * mask, dim=1)
    weight = torch.sum(gates * mask, dim=1)
    return GateOutput(
        l_aux=l_aux,
        capacity=cap,
        indices=indices.unsqueeze(0),
        locations=loc.unsqueeze(0),
        weights=weight.unsqueeze(0),
        exp_counts=exp_counts,
        num_experts=e,
        drop_tokens=drop_tokens,
    )


def top2_gating(
    logits: Tensor,
    capacity_factor: float,
    min_capacity: int,
    *,
    used_token: Tensor | None = None,
    drop_tokens: bool = True,
    second_expert_sampling: bool = True,
) -> GateOutput:
    """GShard top-2 routing of (S, E) fp32 ``logits``; see the module docstring."""
    s, e = logits.shape
    gates = F.softmax(logits, dim=1)  # (S, E)
    first = torch.argmax(gates, dim=1)
    mask1 = F.one_hot(first, num_classes=e)
    scores2 = logits + _gumbel_like(logits) if second_expert_sampling else logits
    second = torch.argmax(scores2.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = F.one_hot(second, num_classes=e)
    mask1, mask2 = _apply_used(mask1, used_token), _apply_used(mask2, used_token)
    loc1 = torch.cumsum(mask1, dim=0) - 1
    # every first choice is placed ahead of every second choice
    loc2 = torch.cumsum(mask2, dim=0) - 1 + torch.sum(mask1, dim=0, keepdim=True)
    l_aux = torch.mean(_mean_load(gates, mask1)) * e * e
    exp_counts = torch.sum(mask1 + mask2, dim=0).detach()
    if drop_tokens:
        cap = capacity(s, e, capacity_factor, min_capacity, k=2)
        mask1 = mask1 * torch.lt(loc1, cap)
        mask2 = mask2 * torch.lt(loc2, cap)
    else:
        cap = int(exp_counts.max().item()) if s else 0
    g1 = torch.sum(gates * mask1, dim=1)
    g2 = torch.sum(gates * mask2, dim=1)
    denom = torch.clamp(g1 + g2, min=torch.finfo(g1.dtype).eps)
    kept1, kept2 = mask1.sum(dim=1) > 0, mask2.sum(dim=1) > 0
    minus = torch.full_like(first, -1)
    return GateOutput(
        l_aux=l_aux,
        capacity=cap,
        indices=torch.stack([torch.where(kept1, first, minus), torch.where(kept2, second, minus)]),
        locations=torch.stack([torch.sum(loc1 * mask1, dim=1), torch.sum(loc2 * mask2, dim=1)]),
        weights=torch.stack([g1 / denom, g2 / denom]),
        exp_counts=exp_counts,
        num_experts=e,
        drop_tokens=drop_tokens,
    )


def topk_gating(
    logits: Tensor,
    k: int,
    capacity_factor: float,
    min_capacity: int,
    *,
    used_token: Tensor | None = None,
    drop_tokens: bool = True,
) -> GateOutput:
    """Top-k routing (any k, used for k > 2) of (S, E) fp32 ``logits``; see the module docstring."""
    s, e = logits.shape
    gates = F.softmax(logits, dim=1)  # (S, E)
    top_gate, top_idx = torch.topk(gates, k=k, dim=1)  # (S, k)
    mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, top_idx, True)
    if used_token is not None:
        mask &= used_token.reshape(-1, 1).bool()
    exp_counts = torch.sum(mask, dim=0).detach()
    l_aux = torch.mean(_mean_load(gates, mask)) * e * e / k
    if drop_tokens:
        cap = capacity(s, e, capacity_factor, min_capacity, k=k)
        # per expert keep the `cap` routes with the largest router probabilities
        chosen_gates = torch.zeros_like(gates).scatter(1, top_idx, top_gate) * mask
        keep = torch.topk(chosen_gates, k=min(cap, s), dim=0, sorted=False)[1]
        mask &= torch.zeros_like(mask).scatter_(0, keep, True)
    else:
        cap = int(exp_counts.max().item()) if s else 0
    locations = torch.cumsum(mask, dim=0) - 1  # (S, E)
    masked = gates * mask
    masked = masked / torch.clamp(torch.sum(masked, dim=-1, keepdim=True), min=torch.finfo(masked.dtype).eps)
    kept = mask.gather(1, top_idx)  # (S, k)
    indices = torch.where(kept, top_idx, torch.full_like(top_idx, -1))
    return GateOutput(
        l_aux=l_aux,
        capacity=cap,
        indices=indices.t().contiguous(),
        locations=(locations.gather(1, top_idx) * kept).t().contiguous(),
        weights=masked.gather(1, top_idx).t().contiguous(),
        exp_counts=exp_counts,
        num_experts=e,
        drop_tokens=drop_tokens,
    )


def _multiplicative_jitter(x: Tensor, epsilon: float = 1e-2) -> Tensor:
    """Multiply by Uniform(1 - epsilon, 1 + epsilon) noise (Switch Transformer's input jitter)."""
    return x * (1.0 - epsilon + 2.0 * epsilon * torch.rand(x.shape, dtype=x.dtype, device=x.device))


class TopKGate(nn.Module):
    """The router: a bias-free linear map to expert logits (in fp32), then top-1/top-2/top-k gating."""

    def __init__(
        self,
        model_dim: int,
        num_experts: int,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        top2_2nd_expert_sampling: bool = True,
    ) -> None:
        super().__init__()
        if noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise MoEConfigError(
                "noisy_gate_policy",
                f"must be one of None, 'None', 'Jitter', 'RSample', got {noisy_gate_policy!r}",
            )
        for name, value in (
            ("capacity_factor", capacity_factor),
            ("eval_capacity_factor", eval_capacity_factor),
        ):
            if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
                raise MoEConfigError(name, f"must be a positive number, got {value!r}")
        if not isinstance(min_capacity, int) or isinstance(min_capacity, bool) or min_capacity < 0:
            raise MoEConfigError("min_capacity", f"must be an int >= 0, got {min_capacity!r}")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= num_experts:
            raise MoEConfigError("k", f"must be an int in [1, num_experts={num_experts}], got {k!r}")
        if noisy_gate_policy == "RSample" and k > 1:
            # DeepSpeed silently ignores it there; say so once instead
            _log.warning("noisy_gate_policy='RSample' only applies to top-1 gating (k=%d): ignored", k)
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.k = k
        self.capacity_factor = float(capacity_factor)
        self.eval_capacity_factor = float(eval_capacity_factor)
        self.min_capacity = min_capacity
        self.noisy_gate_policy = None if noisy_gate_policy == "None" else noisy_gate_policy
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling

    def forward(self, x: Tensor, used_token: Tensor | None = None) -> GateOutput:
        """Route (S, M) tokens ``x``; ``used_token`` (S,) 0/1 excludes padding tokens from routing."""
        x32 = x.float()
        if self.training and self.noisy_gate_policy == "Jitter":
            x32 = _multiplicative_jitter(x32)
        logits = F.linear(x32, self.wg.weight.float())  # (S, E)
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            return top1_gating(
                logits,
                factor,
                self.min_capacity,
                used_token=used_token,
                rsample=self.training and self.noisy_gate_policy == "RSample",
                drop_tokens=self.drop_tokens,
                use_rts=self.training and self.use_rts,
            )
        if self.k == 2:
            return top2_gating(
                logits,
                factor,
                self.min_capacity,
                used_token=used_token,
                drop_tokens=self.drop_tokens,
                second_expert_sampling=self.training and self.top2_2nd_expert_sampling,
            )
        return topk_gating(
            logits, self.k, factor, self.min_capacity, used_token=used_token, drop_tokens=self.drop_tokens
        )
