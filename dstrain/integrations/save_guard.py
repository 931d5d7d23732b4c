"""A Hugging Face model's ``save_pretrained`` under ZeRO-3: a typed error instead of an empty or broken file.

At stage 3 each rank holds only shards of the parameters; between uses ``module.parameters()`` are empty
placeholders, so ``model.save_pretrained(dir)`` writes nothing useful (or fails deep inside safetensors).
`guard_save_pretrained` makes it raise `PartitionedSaveError` naming what to use instead, while the
parameters are released; inside a gather (`dstrain.zero.GatheredParameters`) it saves as usual.
"""

from __future__ import annotations

import functools
import types
from typing import Any, Protocol, runtime_checkable

import torch

from dstrain.errors import PartitionedSaveError

__all__ = ["SavesPretrained", "guard_save_pretrained"]


@runtime_checkable
class SavesPretrained(Protocol):
    """A model with Hugging Face's ``save_pretrained(directory, ...)``: transformers' models, and the
    other libraries that follow its convention (the method is the contract, not a base class)."""

    def save_pretrained(self, *args: Any, **kwargs: Any) -> Any: ...


def guard_save_pretrained(module: torch.nn.Module) -> bool:
    """Wrap ``module.save_pretrained`` (a `SavesPretrained` model's; other modules have none) so it
    refuses while parameters are released. Returns whether the module had one."""
    if not isinstance(module, SavesPretrained) or not callable(module.save_pretrained):
        return False
    original = module.save_pretrained

    @functools.wraps(original)
    def save_pretrained(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        released = any(p.untyped_storage().nbytes() == 0 for p in self.parameters())  # resized to 0
        if released and kwargs.get("state_dict") is None:  # a gathered state_dict passed in is fine
            raise PartitionedSaveError(
                "model.save_pretrained() under ZeRO-3: the parameters are partitioned over the ranks. Use "
                "engine.save_16bit_model(dir) (with zero_optimization.stage3_gather_16bit_weights_on_model_save), "
                "Trainer.save_model() of dstrain.integrations.transformers, or `dstrain export CKPT_DIR OUT_DIR` "
                "on a checkpoint; the config.json can still be written with model.config.save_pretrained(dir)"
            )
        return original(*args, **kwargs)

    module.save_pretrained = types.MethodType(save_pretrained, module)  # type: ignore[method-assign]
    return True
