"""The pipeline room's few lines in `dstrain.initialize`: stages for the topology, tied groups, the runner.

pp = pipeline_stages(model, config)            # build_topology
tied = tied_groups(model, topology)            # before ZeRO flattens parameters (collective)
runner = attach(engine, model, topology, tied, pipeline_config)  # after the engine is built
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.distributed as dist

from dstrain.dist.topology import Topology
from dstrain.errors import ConfigError, NotImplementedConfigError
from dstrain.pipe.config import PipelineConfig
from dstrain.pipe.module import PipelineModule
from dstrain.pipe.runner import PipelineRunner

__all__ = ["attach", "pipeline_stages", "tied_groups"]

_CHANNELS = itertools.count()


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


def tied_groups(model: PipelineModule, topology: Topology) -> dict[str, Any]:
    """Process groups of the ranks holding each tied key (one per data-parallel index); this rank's ones.

    Collective: every rank creates every group in the same order. Each group's tied weights are then made
    equal to those of its lowest stage (a no-op for seeded layers), before ZeRO copies them anywhere.
    """
    layout = topology.layout
    mine: dict[str, Any] = {}
    for key, stages in sorted(model.tied_stages().items()):
        if len(stages) < 2:
            continue
        for d in range(layout.dp):
            ranks = [layout.rank_of(s, d) for s in stages]
            group = dist.new_group(ranks)
            if topology.world.rank in ranks:
                mine[key] = group
                with torch.no_grad():
                    for p in model.tied_weights(key):
                        dist.broadcast(p.data, src=ranks[0], group=group)
    return mine


def attach(
    engine: Any,
    model: PipelineModule,
    topology: Topology,
    tied: dict[str, Any],
    config: PipelineConfig,
    *,
    channel_id: int | None = None,
) -> PipelineRunner:
    """The runner executing ``train_batch``/``eval_batch`` for ``engine`` (built over the local stage).

    ``channel_id`` keeps the messages of several pipelines in one process group apart; by default each
    pipeline built in this process takes the next id (every rank builds its pipelines in the same order).
    """
    pipeline_stages(model, config)
    if model.num_stages > 1 and engine.config.gradient_clipping > 0:
        # the global norm must sum over stages and count tied weights once: not wired to the clip room yet
        raise NotImplementedConfigError(
            "gradient_clipping", "is not implemented with pipeline parallelism yet; set it to 0"
        )
    stage = engine.config.zero_optimization.stage
    if model.num_stages > 1 and stage == 3:
        raise NotImplementedConfigError(
            "zero_optimization.stage", "3 is not implemented with pipeline parallelism; use 0, 1 or 2"
        )
    if stage == 2 and tied:
        # stage 2 moves each micro-batch's gradient into reduced buckets during backward: the tied sum over
        # stages must happen before that, which needs a tied route in the reduction queue (not built yet)
        raise NotImplementedConfigError(
            "zero_optimization.stage",
            "2 with weights tied across pipeline stages is not implemented; use 0 or 1",
        )
    if config.activation_checkpoint_interval:
        model.activation_checkpoint_interval = config.activation_checkpoint_interval
    layout = topology.layout
    pp_group = topology.pp.group
    if topology.world.backend == "nccl" and model.num_stages > 1:
        # NCCL p2p ignores tags and needs CUDA tensors: the p2p messages (tagged headers, metadata) travel on
        # a gloo group of the same ranks; payloads are staged through host memory (p2p.py)
        groups = sorted({tuple(layout.group_of("pp", r)) for r in range(layout.world)})
        mine = tuple(layout.group_of("pp", topology.world.rank))
        for ranks in groups:  # collective: every rank creates every group in the same order
            g = dist.new_group(list(ranks), backend="gloo")
            if ranks == mine:
                pp_group = g
    return PipelineRunner(
        module=model,
        engine=engine,
        micro_batches=engine.config.gradient_accumulation_steps,
        pp_ranks=layout.group_of("pp", topology.world.rank),
        pp_group=pp_group,
        dp_size=layout.dp,
        tied_groups=tied,
        p2p_timeout=config.p2p_timeout,
        channel_id=next(_CHANNELS) if channel_id is None else channel_id,
    )
