"""``"auto"`` values in a DeepSpeed config, resolved where `initialize` can derive them.

Hugging Face's templates (HF Trainer, accelerate, axolotl) say ``"auto"`` for what the trainer knows.
`resolve_auto` fills what dstrain can derive itself, the way HF's DeepSpeed integration does:

- batch sizes: a batch key that is ``"auto"`` is left for `DSConfig.load` to infer from the other two
  and the world size (train = micro x accumulation x data-parallel ranks);
- bucket sizes from the model's hidden size ``h`` (``model.config.hidden_size``, or the largest of
  ``hidden_sizes``): ``reduce_bucket_size`` = h*h, ``stage3_prefetch_bucket_size`` = 0.9*h*h,
  ``stage3_param_persistence_threshold`` = 10*h;
- the optimizer's lr / betas / eps / weight_decay from a client optimizer's defaults (``optimizer=``);
- the schedule's ``warmup_min_lr`` = 0 and ``warmup_max_lr`` = the optimizer's lr.

Everything else (``fp16.enabled``, ``gradient_clipping``, step counts, ...) is the trainer's to say:
`resolve_auto` names every ``"auto"`` left in one `ConfigError`. The Trainer of
`dstrain.integrations.transformers` fills those from its ``TrainingArguments`` first.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch

from dstrain.errors import ConfigError

__all__ = ["AUTO", "auto_paths", "fill_auto", "hidden_size", "resolve_auto"]

AUTO = "auto"

NATIVE = frozenset({"pipeline.stages", "pipeline.transport"})
"""Keys whose section parser takes ``"auto"`` itself (the pipeline's stage count and transport)."""

_BATCH = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def auto_paths(data: Any, prefix: str = "") -> list[str]:
    """Dotted paths of every ``"auto"`` value in ``data``."""
    found: list[str] = []
    if isinstance(data, Mapping):
        for k, v in data.items():
            path = f"{prefix}.{k}" if prefix else str(k)
            if v == AUTO:
                found.append(path)
            else:
                found.extend(auto_paths(v, path))
    return found


def hidden_size(model: torch.nn.Module | None) -> int | None:
    """The model's hidden size as HF's DeepSpeed integration reads it (a transformers config's
    ``hidden_size``, else the largest of ``hidden_sizes``); None when the model has neither."""
    config = getattr(model, "config", None)  # a transformers PreTrainedModel's config (plain data)
    if config is None:
        return None
    size = getattr(config, "hidden_size", None)
    if size is None and getattr(config, "hidden_sizes", None):
        size = max(config.hidden_sizes)
    return int(size) if size is not None else None


def _set(data: dict[str, Any], path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    node = data
    for p in parents:
        node = node[p]
    node[leaf] = value


def _get(data: Mapping[str, Any], path: str) -> Any:
    node: Any = data
    for p in path.split("."):
        if not isinstance(node, Mapping) or p not in node:
            return None
        node = node[p]
    return node


def fill_auto(config: Mapping[str, Any], values: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``config`` with each ``"auto"`` whose dotted path is in ``values`` replaced by that value
    (what a trainer knows: HF's ``fill_match``); other values are left as they are."""
    data: dict[str, Any] = copy.deepcopy(dict(config))
    for path in auto_paths(data):
        if path in values:
            _set(data, path, values[path])
    return data


def resolve_auto(
    config: Mapping[str, Any],
    *,
    model: torch.nn.Module | None = None,
    optimizer: Any = None,
) -> dict[str, Any]:
    """A copy of ``config`` with every derivable ``"auto"`` filled; raises `ConfigError` naming the rest.

    ``optimizer`` is a client torch optimizer (its defaults fill ``optimizer.params``)."""
    data: dict[str, Any] = copy.deepcopy(dict(config))
    left: list[str] = []
    autos = [p for p in auto_paths(data) if p not in NATIVE]
    batch_autos = [p for p in autos if p in _BATCH]
    for p in batch_autos:  # DSConfig.load infers it from the other two and the world size
        del data[p]
    if batch_autos and not any(k in data for k in _BATCH[:2]):
        left.extend(p for p in batch_autos if p != "gradient_accumulation_steps")
    h = hidden_size(model)
    derived: dict[str, Any] = {}
    if h is not None:
        derived.update(
            {
                "zero_optimization.reduce_bucket_size": h * h,
                "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * h * h),
                "zero_optimization.stage3_param_persistence_threshold": 10 * h,
                # DeepSpeed's pydantic names of the same keys (axolotl's zero3_bf16 template)
                "zero_optimization.prefetch_bucket_size": int(0.9 * h * h),
                "zero_optimization.param_persistence_threshold": 10 * h,
            }
        )
    if isinstance(optimizer, torch.optim.Optimizer):
        d = optimizer.defaults
        for key in ("lr", "eps", "weight_decay"):
            if key in d:
                derived[f"optimizer.params.{key}"] = float(d[key])
        if "betas" in d:
            derived["optimizer.params.betas"] = [float(b) for b in d["betas"]]
    lr = derived.get("optimizer.params.lr", _get(data, "optimizer.params.lr"))
    derived["scheduler.params.warmup_min_lr"] = 0.0
    if isinstance(lr, int | float) and not isinstance(lr, bool):
        derived["scheduler.params.warmup_max_lr"] = float(lr)
    for path in autos:
        if path in batch_autos:
            continue
        if path in derived:
            _set(data, path, derived[path])
        else:
            left.append(path)
    if left:
        raise ConfigError(
            left[0],
            f'"auto" cannot be derived here for {", ".join(left)}: give values, or train with '
            "dstrain.integrations.transformers.Trainer, which fills them from TrainingArguments"
            + (
                ""
                if h is not None or not any("zero_optimization" in p for p in left)
                else " (bucket sizes come from model.config.hidden_size, which this model lacks)"
            ),
        )
    return data
