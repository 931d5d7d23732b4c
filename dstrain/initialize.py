"""`initialize`: DeepSpeed's entry point — build the engine, optimizer, data loader and LR schedule."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from dstrain.checkpoint import CheckpointStore, default_store
from dstrain.comm import Comm
from dstrain.config import DSConfig
from dstrain.engine import Engine
from dstrain.optim import ClientOptimizer, build_optimizer
from dstrain.precision import Precision
from dstrain.scheduler import LRSchedule, build_scheduler
from dstrain.zero.base import ZeroStrategy
from dstrain.zero.dp import DataParallelZero

__all__ = ["init_distributed", "initialize"]


def init_distributed(backend: str | None = None) -> bool:
    """Create the default process group when launched by torchrun with WORLD_SIZE > 1.

    Returns True when a process group exists afterwards. Without a launcher (or WORLD_SIZE 1) nothing
    is created: world size 1 needs no process group.
    """
    if dist.is_initialized():
        return True
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    dist.init_process_group(backend or ("nccl" if torch.cuda.is_available() else "gloo"))
    return True


def _param_groups(module: torch.nn.Module, model_parameters: Iterable[Any] | None) -> list[dict[str, Any]]:
    """Optimizer groups of trainable parameters; every parameter must belong to ``module``."""
    items = list(module.parameters() if model_parameters is None else model_parameters)
    if items and isinstance(items[0], dict):
        groups = [dict(g, params=list(g["params"])) for g in items]
    else:
        groups = [{"params": items}]
    owned = {id(p) for p in module.parameters()}
    seen: set[int] = set()
    for g in groups:
        for p in g["params"]:
            if id(p) not in owned:
                raise ValueError("model_parameters holds a tensor that is not a parameter of model")
            if id(p) in seen:
                raise ValueError("a parameter appears twice in model_parameters")
            seen.add(id(p))
        g["params"] = [p for p in g["params"] if p.requires_grad]
    return [g for g in groups if g["params"]]


def _broadcast_module(module: torch.nn.Module, comm: Comm) -> None:
    """Make every rank start from rank 0's weights and buffers."""
    if comm.world_size == 1:
        return
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(t.data, src=0, group=comm.group)


def _build_zero(
    module: torch.nn.Module, groups: list[dict[str, Any]], config: DSConfig, comm: Comm, dtype: torch.dtype
) -> ZeroStrategy:
    stage = config.zero_optimization.stage
    if stage == 3:
        from dstrain.zero.stage3 import Stage3Zero

        return Stage3Zero(module, groups, config=config.zero_optimization, comm=comm, dtype=dtype)
    return DataParallelZero(groups, stage=stage, config=config.zero_optimization, comm=comm, dtype=dtype)


def initialize(
    args: Any = None,
    model: torch.nn.Module | None = None,
    optimizer: ClientOptimizer | None = None,
    model_parameters: Iterable[Any] | None = None,
    training_data: Dataset[Any] | None = None,
    lr_scheduler: Callable[[torch.optim.Optimizer], LRSchedule] | None = None,
    config: dict[str, Any] | str | os.PathLike[str] | None = None,
    config_params: dict[str, Any] | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    dist_init_required: bool | None = None,
    checkpoint_store: CheckpointStore | None = None,
) -> tuple[Engine, torch.optim.Optimizer, DataLoader[Any] | None, LRSchedule | None]:
    """DeepSpeed-compatible: returns (engine, optimizer, training dataloader or None, LR schedule or None).

    ``model`` is modified in place: cast to the compute dtype, its trainable parameters moved into flat
    (and, at stage 3, partitioned) storage. ``optimizer`` may be a fresh torch optimizer (rebuilt with
    its class and defaults over the fp32 master tensors) or a callable taking param groups;
    ``lr_scheduler`` a callable taking the optimizer. ``args.deepspeed_config`` is read like DeepSpeed.
    """
    if model is None:
        raise ValueError("initialize needs model=")
    if config is None:
        config = config_params if config_params is not None else getattr(args, "deepspeed_config", None)
    if config is None:
        raise ValueError("initialize needs config= (a DeepSpeed JSON dict or path)")
    if dist_init_required is not False:
        init_distributed()
    comm = Comm()
    cfg = DSConfig.load(config, world_size=comm.world_size)
    if cfg.seed is not None:
        torch.manual_seed(cfg.seed)
    precision = Precision(cfg.precision, cfg.fp16)
    groups = _param_groups(model, model_parameters)
    if comm.distributed and dist.get_backend(comm.group) == "nccl":
        # NCCL talks to the GPU: put the model on this process's device, as DeepSpeed does
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        model.to(device)
    _broadcast_module(model, comm)
    model.to(precision.dtype)
    zero = _build_zero(model, groups, cfg, comm, precision.dtype)
    torch_optimizer = build_optimizer(zero.param_groups(), cfg.optimizer, optimizer)
    if lr_scheduler is not None:
        if not callable(lr_scheduler) or isinstance(lr_scheduler, LRSchedule):
            raise ValueError(
                "lr_scheduler must be a callable taking the optimizer (it is rebuilt over ZeRO's)"
            )
        schedule: LRSchedule | None = lr_scheduler(torch_optimizer)
    elif cfg.scheduler is not None:
        schedule = build_scheduler(torch_optimizer, cfg.scheduler)
    else:
        schedule = None
    loader = None
    if training_data is not None:
        sampler: DistributedSampler[Any] = DistributedSampler(
            training_data, num_replicas=comm.world_size, rank=comm.rank, shuffle=True, seed=cfg.seed or 0
        )
        loader = DataLoader(
            training_data,
            batch_size=cfg.train_micro_batch_size_per_gpu,
            sampler=sampler,
            collate_fn=collate_fn,
        )
    engine = Engine(
        module=model,
        config=cfg,
        comm=comm,
        precision=precision,
        zero=zero,
        optimizer=torch_optimizer,
        lr_scheduler=schedule,
        store=checkpoint_store or default_store(),
    )
    return engine, torch_optimizer, loader, schedule
