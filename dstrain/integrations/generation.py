"""A transformers model's ``generate`` under ZeRO-3: ``synced_gpus`` on by default across ranks.

At stage 3 each forward gathers every module's parameters with collectives over the ranks (the
`dstrain.zero.gather.GatherScheduler` hooks), so all ranks must run the same number of forwards.
Greedy or sampled generation stops a rank when its sequences end (EOS, or a shorter budget): with
different prompts on different ranks, the rank that finishes first leaves the others waiting in a
gather forever. HF's ``generate(..., synced_gpus=True)`` keeps a finished rank running forwards
(their outputs discarded) until every rank is done. HF turns it on by itself only under DeepSpeed
ZeRO-3 or FSDP (``is_deepspeed_zero3_enabled()`` reads a global that DeepSpeed's config object sets,
and that also makes ``from_pretrained`` build models under ``deepspeed.zero.Init``, so dstrain does
not set it). `default_synced_gpus` gives a dstrain ZeRO-3 model HF's default for DeepSpeed instead:
``synced_gpus`` left out (or None) is True; a value the caller passes is kept.
"""

from __future__ import annotations

import functools
import types
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["Generates", "default_synced_gpus"]


@runtime_checkable
class Generates(Protocol):
    """A model with Hugging Face's ``generate(inputs, ..., synced_gpus=None, ...)``: transformers'
    generative models (``GenerationMixin``; the method is the contract, not a base class)."""

    def generate(self, *args: Any, **kwargs: Any) -> Any: ...


def default_synced_gpus(module: torch.nn.Module) -> bool:
    """Wrap ``module.generate`` (a `Generates` model's; other modules have none) so that
    ``synced_gpus`` defaults to True. Returns whether the module had one."""
    if not isinstance(module, Generates) or not callable(module.generate):
        return False
    original = module.generate

    @functools.wraps(original)
    def generate(self: torch.nn.Module, *args: Any, synced_gpus: bool | None = None, **kwargs: Any) -> Any:
        return original(*args, synced_gpus=True if synced_gpus is None else synced_gpus, **kwargs)

    module.generate = types.MethodType(generate, module)  # type: ignore[method-assign]
    return True
