"""The pipeline room's few lines in `dstrain.initialize`: stages for the topology, tied groups, the runner.

pp = pipeline_stages(model, config)            # build_topology (1 for a model that is not a pipeline)
if applies(config, model):                     # the model is a `PipelineModule`
    tied = tied_groups(model, topology)        # before ZeRO flattens parameters (collective)
    pipe = build(model, zero, topology, tied, config)   # Engine(..., grad_sets=pipe.grad_sets, runner=pipe.runner)
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dstrain.config import DSConfig
from dstrain.dist.groups import new_group
from dstrain.dist.topology import Topology
from dstrain.errors import ConfigError, NotImplementedConfigError
from dstrain.optim.clip import GradSet
from dstrain.pipe.config import PipelineConfig
from dstrain.pipe.grads import StageGrads, TiedGroup
from dstrain.pipe.module import PipelineModule
from dstrain.pipe.runner import PipelineRunner
from dstrain.pipe.transport import Transport

__all__ = ["Pipeline", "applies", "build", "pipeline_stages", "tied_groups"]

_CHANNELS = itertools.count()


def applies(config: DSConfig | None, model: torch.nn.Module) -> bool:
    """The model is a `PipelineModule` (its stages, tied groups and runner are this room's)."""
    return isinstance(model, PipelineModule)


def pipeline_stages(model: torch.nn.Module, config: PipelineConfig | None = None) -> int:
    """Pipeline degree for the topology: the module's ``num_stages`` (1 for any other model)."""
    if not isinstance(model, PipelineModule):
        if config is not None and config.stages not in ("auto", 1):
            raise ConfigError(
                "pipeline.stages", "a pipeline needs the model to be a dstrain.pipe.PipelineModule"
            )
        return 1
    if config is not None and config.stages != "auto" and config.stages != model.num_stages:
        raise ConfigError(
            "pipeline.stages",
            f"{config.stages} differs from the PipelineModule's num_stages ({model.num_stages})",
        )
    return model.num_stages


def tied_groups(model: torch.nn.Module, topology: Topology) -> dict[str, TiedGroup]:
    """Process groups of the ranks holding each tied key (one per data-parallel index, and one of every
    data-parallel index: ZeRO 2 sums the master gradient's slices over it); this rank's ones (none for
    a model that is not a pipeline).

    Collective: every rank creates every group in the same order. Each group's tied weights are then made
    equal to those of its lowest stage (a no-op for seeded layers), before ZeRO copies them anywhere.
    """
    if not isinstance(model, PipelineModule):
        return {}
    layout = topology.layout
    mine: dict[str, TiedGroup] = {}
    for key, stages in sorted(model.tied_stages().items()):
        if len(stages) < 2:
            continue
        same_dp = None
        for d in range(layout.dp):
            ranks = [layout.rank_of(s, d) for s in stages]
            group = new_group(ranks)
            if topology.world.rank in ranks:
                same_dp = group
                with torch.no_grad():
                    for p in model.tied_weights(key):
                        dist.broadcast(p.data, src=ranks[0], group=group)
        every = sorted(layout.rank_of(s, d) for s in stages for d in range(layout.dp))
        all_dp = new_group(every) if layout.dp > 1 else same_dp
        if same_dp is not None:
            mine[key] = TiedGroup(same_dp=same_dp, all_dp=all_dp)
    return mine


@dataclass(frozen=True, slots=True)
class Pipeline:
    """What a pipeline model gives the `Engine`: the norm's gradient sets and its batch runner."""

    grad_sets: Callable[[], list[GradSet]] | None
    """The gradient sets of the whole model, summed over the stages (None with one stage: ZeRO's)."""
    runner: Callable[[Any], PipelineRunner]
    """Builds the runner of ``train_batch``/``eval_batch`` over the engine (collective)."""


def build(
    model: torch.nn.Module,
    zero: Any,
    topology: Topology,
    tied: dict[str, TiedGroup],
    config: DSConfig,
    *,
    channel_id: int | None = None,
) -> Pipeline:
    """The pipeline's parts for the `Engine` (built over the local stage): gradient sets summed over
    the stages, and the runner executing ``train_batch``/``eval_batch``. Where `applies` (a
    `PipelineModule`; any other model raises ``TypeError``).

    ``channel_id`` keeps the messages of several pipelines in one process group apart; by default each
    pipeline built in this process takes the next id (every rank builds its pipelines in the same order).
    """
    if not isinstance(model, PipelineModule):
        raise TypeError(
            f"the pipeline room builds a PipelineModule, not {type(model).__name__} (see applies)"
        )
    pipeline = config.pipeline
    pipeline_stages(model, pipeline)
    if model.num_stages > 1 and config.zero_optimization.stage == 3:
        raise NotImplementedConfigError(
            "zero_optimization.stage", "3 is not implemented with pipeline parallelism; use 0, 1 or 2"
        )
    reduce_tied = None
    grad_sets = None
    if model.num_stages > 1:
        grads = StageGrads(module=model, zero=zero, topology=topology, tied=tied)
        if config.gradient_clipping > 0:
            grads.check_clipping()
        grad_sets = grads.grad_sets  # the norm of the whole model: summed over the stages
        reduce_tied = grads.reduce_tied if tied else None
    if pipeline.activation_checkpoint_interval:
        model.activation_checkpoint_interval = pipeline.activation_checkpoint_interval
    layout = topology.layout
    channel = next(_CHANNELS) if channel_id is None else channel_id

    def runner(engine: Any) -> PipelineRunner:
        return PipelineRunner(
            module=model,
            engine=engine,
            micro_batches=config.gradient_accumulation_steps,
            pp_ranks=layout.group_of("pp", topology.world.rank),
            pp_group=topology.pp.group,
            dp_size=layout.dp,
            reduce_tied=reduce_tied,
            p2p_timeout=pipeline.p2p_timeout,
            channel_id=channel,
            transport=transport_for(topology, model, pipeline),
        )

    return Pipeline(grad_sets=grad_sets, runner=runner)


def transport_for(topology: Topology, model: PipelineModule, config: PipelineConfig) -> Transport:
    """The pipeline's `Transport` (``config.transport``). gloo: host tensors with tags over the pipeline
    group. NCCL, ``"auto"``/``"nccl"``: CUDA tensors natively over a group per direction, receives posted just
    in time; ``"staged"``: the same tagged messages as gloo over a gloo group of the pipeline ranks, CUDA
    payloads staged through host memory, the batch status reduced on the GPU. ``"ordered"`` runs NCCL's
    discipline on gloo (tests).
    Collective: every rank calls it."""
    layout = topology.layout
    mine = layout.group_of("pp", topology.world.rank)
    every = sorted({tuple(layout.group_of("pp", r)) for r in range(layout.world)})
    pp_ranks = [list(g) for g in every]
    if topology.world.backend == "nccl":
        device = next(model.parameters(), torch.empty(0)).device
        if device.type != "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        if model.num_stages == 1:  # no p2p; the batch status is still reduced on the GPU
            return Transport(forward=None, backward=None, device=device, tagged=False, poll=True)
        if config.transport == "staged":
            return Transport.staged(pp_ranks, mine, status_device=device)
        return Transport.nccl(pp_ranks, mine, device)
    if model.num_stages > 1 and config.transport == "ordered":
        return Transport.gloo_ordered(pp_ranks, mine)
    return Transport.gloo(topology.pp.group)
