"""`PipelineModule`: a flat list of layers split into stages, of which each rank builds only its own.

DeepSpeed's names and arguments, so a pipeline script ports by changing the import::

    layers = [TiedLayerSpec("emb", Embedding, vocab, dim), *[LayerSpec(Block, dim) for _ in range(n)],
              TiedLayerSpec("emb", Embedding, vocab, dim, forward_fn=lm_head)]
    model = PipelineModule(layers, num_stages=2, loss_fn=cross_entropy, partition_method="parameters")

Differences from DeepSpeed, on purpose:

- Counting parameters for ``"parameters"`` partitioning builds each `LayerSpec` on the ``meta`` device, so no
  rank ever allocates another stage's weights (DeepSpeed builds every layer on every rank to count them).
- With ``seed_layers`` a tied module is seeded by its key's first position in ``layers``, so every stage that
  holds it builds the same weights (the runner still broadcasts them once, for unseeded builds).
- A stage left without layers, or a ``type:`` regex matching nothing, is a `PartitionError`.
"""

from __future__ import annotations

import logging
import os
import re
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from dstrain.pipe.errors import PartitionError, ProcessGroupMissingError

__all__ = [
    "LayerSpec",
    "PipelineModule",
    "TiedLayerSpec",
    "partition_balanced",
    "partition_uniform",
]

log = logging.getLogger(__name__)

Layer = Any  # a LayerSpec, an nn.Module or a callable taking and returning activations


class LayerSpec:
    """A layer not built yet: ``typename(*module_args, **module_kwargs)`` when its stage builds it."""

    def __init__(self, typename: type[nn.Module], *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise TypeError(f"LayerSpec needs an nn.Module subclass, got {typename!r}")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self) -> nn.Module:
        """Construct the module (on the current default device)."""
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        args = [repr(a) for a in self.module_args] + [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{type(self).__name__}({self.typename.__name__}, {', '.join(args)})"


class TiedLayerSpec(LayerSpec):
    """A layer whose module is shared by every position with the same ``key`` (e.g. embedding and LM head).

    Each stage holding the key builds the module once; ``forward_fn(module, x)`` (default ``module(x)``) is
    what the position computes. The attributes in ``tied_weight_attr`` are the tied weights: their gradients
    are summed over the stages that hold the key, and they stay bitwise identical across those stages.
    """

    def __init__(
        self,
        key: str,
        typename: type[nn.Module],
        *module_args: Any,
        forward_fn: Callable[[nn.Module, Any], Any] | None = None,
        tied_weight_attr: str | Sequence[str] = ("weight",),
        **module_kwargs: Any,
    ) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        if not isinstance(key, str) or not key:
            raise TypeError(f"TiedLayerSpec key must be a non-empty str, got {key!r}")
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = (
            (tied_weight_attr,) if isinstance(tied_weight_attr, str) else tuple(tied_weight_attr)
        )
        if not self.tied_weight_attr:
            raise ValueError(f"TiedLayerSpec {key!r}: tied_weight_attr is empty")


# -- partitioning --------------------------------------------------------------------------------------


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Boundaries ``parts`` (length ``num_parts + 1``) giving each part ``num_items // num_parts`` items, the
    first ``num_items % num_parts`` parts one more (DeepSpeed's split). Part ``p`` is ``[parts[p], parts[p+1])``."""
    base, extra = divmod(num_items, num_parts)
    parts = [0]
    for p in range(num_parts):
        parts.append(parts[-1] + base + (1 if p < extra else 0))
    return parts


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """Contiguous boundaries minimising the heaviest part (ties: the lightest part as heavy as possible).

    Every part gets at least one item. Dynamic programming over (items, parts): O(n^2 p), fine for the
    hundreds of layers a model has.
    """
    n = len(weights)
    if n < num_parts:
        raise PartitionError(f"{n} layers cannot fill {num_parts} stages")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    inf = (float("inf"), float("-inf"))
    # best[j][i]: (max part, -min part) splitting the first i items into j parts; cut[j][i]: start of part j
    best = [[inf] * (n + 1) for _ in range(num_parts + 1)]
    cut = [[0] * (n + 1) for _ in range(num_parts + 1)]
    best[0][0] = (0.0, float("-inf"))
    for j in range(1, num_parts + 1):
        for i in range(j, n - (num_parts - j) + 1):
            for k in range(j - 1, i):
                prev_max, prev_negmin = best[j - 1][k]
                if prev_max == float("inf"):
                    continue
                part = prefix[i] - prefix[k]
                prev_min = float("inf") if j == 1 else -prev_negmin
                cand = (max(prev_max, part), -min(prev_min, part))
                if cand < best[j][i]:
                    best[j][i] = cand
                    cut[j][i] = k
    parts = [n]
    i = n
    for j in range(num_parts, 0, -1):
        i = cut[j][i]
        parts.append(i)
    return parts[::-1]


#: The callables that carry a name of their own (functions, builtins, bound and unbound methods).
_FUNCTIONS = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.MethodDescriptorType)


def _layer_name(layer: Layer) -> str:
    """The name ``partition_method="type:..."`` matches: a spec's or module's class, a function's own
    name (``torch.relu``, ``torch.Tensor.relu``, a lambda's ``<lambda>``), any other callable's class (``functools.partial``)."""
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, _FUNCTIONS):
        return layer.__name__
    return type(layer).__name__


def _count_params(layer: Layer) -> int:
    """Trainable parameters of a layer, without allocating them (LayerSpecs are built on the meta device)."""
    if isinstance(layer, nn.Module):
        return sum(p.numel() for p in layer.parameters() if p.requires_grad)
    if not isinstance(layer, LayerSpec):
        return 0
    try:
        with torch.device("meta"):
            module = layer.build()
    except Exception as e:  # a constructor that cannot run on meta: count on CPU, one layer at a time
        log.warning("counting %r on CPU (meta build failed: %s)", layer, e)
        module = layer.build()
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def partition_layers(layers: Sequence[Layer], num_stages: int, method: str) -> list[int]:
    """Stage boundaries for ``layers`` by ``method``: "parameters", "uniform" or "type:<regex>"."""
    if not isinstance(method, str):
        raise PartitionError(f"partition_method must be a str, got {method!r}")
    n = len(layers)
    if n < num_stages:
        raise PartitionError(f"{n} layers cannot fill {num_stages} stages")
    low = method.lower()
    if low == "uniform":
        return partition_uniform(n, num_stages)
    if low == "parameters":
        weights = [_count_params(layer) for layer in layers]
        if not any(weights):
            return partition_uniform(n, num_stages)
        return partition_balanced(weights, num_stages)
    if low.startswith("type:"):
        pattern = method[len("type:") :]
        try:
            regex = re.compile(pattern, re.IGNORECASE)
        except re.error as e:
            raise PartitionError(f"partition_method {method!r}: bad regex: {e}") from e
        weights = [1 if regex.search(_layer_name(layer)) else 0 for layer in layers]
        if sum(weights) < num_stages:
            raise PartitionError(
                f"partition_method {method!r} matches {sum(weights)} layers; each of {num_stages} stages needs one"
            )
        parts = partition_balanced(weights, num_stages)
        for p in range(num_stages):  # a part must hold a matching layer, not only unmatched ones
            if not any(weights[parts[p] : parts[p + 1]]):
                raise PartitionError(f"partition_method {method!r} leaves stage {p} without a matching layer")
        return parts
    raise PartitionError(
        f"partition_method must be 'parameters', 'uniform' or 'type:<regex>', got {method!r}"
    )


# -- the module ----------------------------------------------------------------------------------------


class _TiedForward(nn.Module):
    """One position of a tied module: ``forward_fn(module, x)`` or ``module(x)``; holds no parameters itself."""

    def __init__(
        self, owner: PipelineModule, key: str, forward_fn: Callable[[nn.Module, Any], Any] | None
    ) -> None:
        super().__init__()
        self._owner = [owner]  # a list: not registered as a submodule (no reference cycle in state_dict)
        self.key = key
        self.forward_fn = forward_fn

    def forward(self, x: Any) -> Any:
        module = self._owner[0].tied_modules[self.key]
        return self.forward_fn(module, x) if self.forward_fn is not None else module(x)


class _Fn(nn.Module):
    """A plain callable layer (e.g. a lambda or ``torch.relu``)."""

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: Any) -> Any:
        return self.fn(x)


def _default_stage(num_stages: int) -> tuple[int, int]:
    """(stage of this rank, world size) from the default process group (pipeline outermost)."""
    if not dist.is_initialized():
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if launched > 1 and num_stages > 1:
            raise ProcessGroupMissingError(
                f"WORLD_SIZE is {launched} but no process group exists yet: every rank would build stage 0; "
                "call dstrain.init_distributed() (or torch.distributed.init_process_group) before PipelineModule"
            )
        return 0, 1
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % num_stages:
        raise PartitionError(f"num_stages ({num_stages}) must divide the world size ({world})")
    return rank // (world // num_stages), world


class PipelineModule(nn.Module):
    """The layers of one pipeline stage, cut from the flat ``layers`` list; the rest are never built.

    ``layers`` holds `LayerSpec`/`TiedLayerSpec` (built here, only for this stage), ``nn.Module`` instances
    (kept as given) and callables. ``num_stages`` must divide the world size; this rank's stage is
    ``rank // (world // num_stages)`` (the topology's layout, pipeline outermost), or ``stage_id`` when given
    (no process group needed: tests, single-process references). ``loss_fn(outputs, labels)`` is applied on the
    last stage. ``activation_checkpoint_interval`` > 0 recomputes each run of that many layers in backward
    instead of keeping its activations.

    State-dict keys are the layers' global positions (``"3.weight"``) and ``"tied_modules.<key>.*"``, the same
    for any partitioning.
    """

    def __init__(
        self,
        layers: Sequence[Layer],
        num_stages: int | None = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        partition_method: str = "parameters",
        activation_checkpoint_interval: int = 0,
        seed_layers: bool = False,
        base_seed: int = 1234,
        *,
        stage_id: int | None = None,
    ) -> None:
        super().__init__()
        layers = list(layers)
        if not layers:
            raise PartitionError("layers is empty")
        for i, layer in enumerate(layers):
            if not (isinstance(layer, (LayerSpec, nn.Module)) or callable(layer)):
                raise TypeError(f"layers[{i}] is neither a LayerSpec, an nn.Module nor callable: {layer!r}")
        if num_stages is None:
            if dist.is_initialized():
                raise PartitionError("num_stages is required when a process group exists")
            num_stages = 1
        if not isinstance(num_stages, int) or isinstance(num_stages, bool) or num_stages < 1:
            raise PartitionError(f"num_stages must be a positive int, got {num_stages!r}")
        if not isinstance(activation_checkpoint_interval, int) or activation_checkpoint_interval < 0:
            raise ValueError(
                f"activation_checkpoint_interval must be an int >= 0, got {activation_checkpoint_interval!r}"
            )
        if stage_id is None:
            stage_id, _ = _default_stage(num_stages)
        elif not 0 <= stage_id < num_stages:
            raise PartitionError(f"stage_id must be in [0, {num_stages}), got {stage_id}")
        self.num_stages = num_stages
        self.stage_id = stage_id
        self.loss_fn = loss_fn
        self.partition_method = partition_method
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.seed_layers = seed_layers
        self.base_seed = base_seed
        self.parts = partition_layers(layers, num_stages, partition_method)
        self._layer_names = [_layer_name(layer) for layer in layers]
        self._tied_specs: dict[str, TiedLayerSpec] = {}
        self._tied_first: dict[str, int] = {}
        self._tied_stages: dict[str, list[int]] = {}
        for i, layer in enumerate(layers):
            if isinstance(layer, TiedLayerSpec):
                self._tied_specs.setdefault(layer.key, layer)
                self._tied_first.setdefault(layer.key, i)
                stages = self._tied_stages.setdefault(layer.key, [])
                if self.stage_of(i) not in stages:
                    stages.append(self.stage_of(i))
        self.tied_modules = nn.ModuleDict()
        self.start, self.stop = self.parts[stage_id], self.parts[stage_id + 1]
        self._local: list[tuple[int, nn.Module]] = []
        for i in range(self.start, self.stop):
            self._local.append((i, self._build(i, layers[i])))

    def _build(self, index: int, layer: Layer) -> nn.Module:
        if isinstance(layer, TiedLayerSpec):
            if layer.key not in self.tied_modules:
                with torch.random.fork_rng(enabled=self.seed_layers):
                    if self.seed_layers:
                        torch.manual_seed(self.base_seed + self._tied_first[layer.key])
                    self.tied_modules[layer.key] = layer.build()
            return _TiedForward(self, layer.key, layer.forward_fn)
        if isinstance(layer, LayerSpec):
            with torch.random.fork_rng(enabled=self.seed_layers):
                if self.seed_layers:
                    torch.manual_seed(self.base_seed + index)
                module = layer.build()
        elif isinstance(layer, nn.Module):
            module = layer
        else:
            module = _Fn(layer)
        self.add_module(str(index), module)
        return module

    # -- layout --------------------------------------------------------------------------------------

    def stage_of(self, layer_index: int) -> int:
        """The stage holding global layer ``layer_index``."""
        for s in range(self.num_stages):
            if self.parts[s] <= layer_index < self.parts[s + 1]:
                return s
        raise IndexError(f"layer {layer_index} is outside [0, {self.parts[-1]})")

    @property
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def tied_stages(self) -> dict[str, list[int]]:
        """Each tied key and the stages holding it (the same on every rank; computed without building)."""
        return {k: list(v) for k, v in self._tied_stages.items()}

    def tied_weights(self, key: str) -> list[nn.Parameter]:
        """The tied parameters of ``key`` on this stage (``tied_weight_attr`` of its spec, dotted paths allowed)."""
        module: Any = self.tied_modules[key]
        out = []
        for attr in self._tied_specs[key].tied_weight_attr:
            obj = module
            for part in attr.split("."):
                obj = getattr(obj, part)
            out.append(obj)
        return out

    def layer_names(self) -> list[str]:
        """Class names of every layer of the whole model (for logs and partition checks)."""
        return list(self._layer_names)

    # -- compute -------------------------------------------------------------------------------------

    def _run(self, start: int, stop: int, x: Any) -> Any:
        for _, module in self._local[start:stop]:
            x = module(x)
        return x

    def forward(self, x: Any) -> Any:
        """This stage's layers in order; each takes the previous one's output (a tensor or a tuple)."""
        n = len(self._local)
        interval = self.activation_checkpoint_interval
        if interval == 0 or not torch.is_grad_enabled():
            return self._run(0, n, x)
        for lo in range(0, n, interval):
            hi = min(lo + interval, n)
            packed = isinstance(x, tuple)
            args = x if packed else (x,)

            def run(*a: Any, lo: int = lo, hi: int = hi, packed: bool = packed) -> Any:
                return self._run(lo, hi, a if packed else a[0])

            # non-reentrant checkpoint: recomputes [lo, hi) in backward, RNG state (dropout) restored
            x = checkpoint(run, *args, use_reentrant=False)
        return x

    def extra_repr(self) -> str:
        return (
            f"stage={self.stage_id}/{self.num_stages}, layers=[{self.start}, {self.stop}), parts={self.parts}"
        )
