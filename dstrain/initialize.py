"""`initialize`: DeepSpeed's entry point, a composer of rooms that reads top to bottom.

    topology -> precision -> zero (routes, + offload) -> stepper -> schedule, data -> Engine

Each room is built by one function below (`build_topology`, `build_routes`, `build_zero`,
`build_stepper`, ...). A feature is a folder of its own (``dstrain/offload``, ``pipe``, ``moe``,
``onebit``) plugged in with a few lines in one of these functions: never a branch in the engine,
never an engine subclass.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from dstrain.checkpoint import CheckpointStore, default_store
from dstrain.checkpointing import compose as activation_checkpointing
from dstrain.config import DSConfig, read_config_file
from dstrain.config_auto import resolve_auto
from dstrain.dist import comms_logger, lifetime
from dstrain.dist.groups import collective_timeout, set_timeout
from dstrain.dist.topology import Layout, Topology
from dstrain.engine import Engine
from dstrain.errors import ConfigError
from dstrain.integrations.generation import default_synced_gpus
from dstrain.integrations.save_guard import guard_save_pretrained
from dstrain.moe import compose as moe
from dstrain.monitor import compose as monitors
from dstrain.offload import compose as offload
from dstrain.onebit import compose as onebit
from dstrain.optim.build import ClientOptimizer, build_optimizer, client_param_groups, stepped_groups
from dstrain.optim.stepper import NoOptimizer, Stepper, TorchStepper, WrapsOptimizer
from dstrain.pipe import compose as pipeline
from dstrain.precision import Precision
from dstrain.profiling import compose as flops_profiler
from dstrain.scheduler import LRSchedule, build_scheduler
from dstrain.zero import init as zero_init
from dstrain.zero.base import ZeroStrategy
from dstrain.zero.dp import DataParallelZero
from dstrain.zero.reduce import Route, default_routes

__all__ = [
    "build_routes",
    "build_schedule",
    "build_stepper",
    "build_topology",
    "build_zero",
    "init_distributed",
    "initialize",
]


def init_distributed(backend: str | None = None, timeout: datetime.timedelta | float | None = None) -> bool:
    """Create the default process group when launched by torchrun with WORLD_SIZE > 1.

    ``backend``: None picks NCCL where CUDA is available, else gloo. ``timeout`` (DeepSpeed's
    argument; a ``timedelta`` or seconds): how long a collective of the default group waits for the
    other ranks before it fails (None: torch's default); the groups dstrain makes later take the
    config's ``dist_timeout`` (or this one). Returns True when a process group exists afterwards.
    Without a launcher (or WORLD_SIZE 1) nothing is created: world size 1 needs no process group. The
    group is destroyed at exit if the script does not (dstrain.dist.lifetime).
    """
    if dist.is_initialized():
        return True
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    kwargs: dict[str, Any] = {}
    if timeout is not None:
        kwargs["timeout"] = collective_timeout(timeout)
        set_timeout(timeout)  # the groups made later too, unless the config says otherwise
    dist.init_process_group(backend or ("nccl" if torch.cuda.is_available() else "gloo"), **kwargs)
    lifetime.track_process_group()
    return True


# -- the rooms, in the order initialize builds them -------------------------------------------------


def build_topology(model: torch.nn.Module, config: dict[str, Any] | str | os.PathLike[str]) -> Topology:
    """The process groups. Pipeline stages (``pp``) and expert parallelism (``ep``) come from the model
    (a pipeline module's stages, its MoE layers' ``ep_size``) when those rooms are in; else 1 and 1."""
    return Topology.from_world(pp=pipeline.pipeline_stages(model), ep=moe.expert_parallel_size(model))


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


def build_routes(
    groups: list[dict[str, Any]], topology: Topology, config: DSConfig | None = None
) -> list[Route]:
    """How each param group's gradients are reduced, and over which group it is partitioned.

    Default: all-reduce / reduce-scatter over the data-parallel group. MoE routes expert groups over
    ``topology.edp``; 1-bit Adam replaces the reducer (dstrain/onebit).
    """
    if onebit.applies(config):
        return onebit.build_routes(groups, topology)  # refuses pipeline and expert parallelism
    return moe.expert_routes(groups, default_routes(groups, topology.dp), topology)  # expert groups only


def _place_and_broadcast(
    module: torch.nn.Module, groups: list[dict[str, Any]], routes: list[Route], topology: Topology
) -> None:
    """NCCL: move the model to this process's GPU. Then every rank starts from the weights of rank 0 of
    its groups: each trainable parameter over its route's group, buffers and frozen ones over dp."""
    if topology.world.backend == "nccl":
        # NCCL talks to the GPU: put the model on this process's device, as DeepSpeed does
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        module.to(device)
    comm_of = {id(p): route.comm for g, route in zip(groups, routes, strict=True) for p in g["params"]}
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            if zero_init.is_partitioned(t):
                continue  # built under zero.Init: rank 0's values were broadcast before partitioning
            comm_of.get(id(t), topology.dp).broadcast(t.data, src=0)


def build_zero(
    module: torch.nn.Module,
    groups: list[dict[str, Any]],
    routes: list[Route],
    config: DSConfig,
    topology: Topology,
    dtype: torch.dtype,
) -> ZeroStrategy:
    """The ZeRO strategy of the configured stage, partitioning over the data-parallel group."""
    zc = config.zero_optimization
    if zc.stage == 3:
        from dstrain.zero.stage3 import Stage3Zero

        store = offload.build_param_store(zc, dtype, config.aio)  # offload_param: shards on CPU/NVMe
        return Stage3Zero(
            module, groups, config=zc, comm=topology.dp, dtype=dtype, routes=routes, store=store
        )
    return DataParallelZero(groups, stage=zc.stage, config=zc, comm=topology.dp, dtype=dtype, routes=routes)


def build_stepper(zero: ZeroStrategy, config: DSConfig, client: ClientOptimizer | None) -> Stepper:
    """What steps the master weights: a `TorchStepper` over the built optimizer. An offloading stepper
    (``offload_optimizer``) or 1-bit Adam returns its own `Stepper` here.

    A client callable (``initialize(optimizer=fn)``) is called with ZeRO's param groups and may return
    a torch optimizer or a `Stepper` of its own.
    """
    zc = config.zero_optimization
    if offload.applies(config):  # ZeRO-Infinity: optimizer state on CPU or NVMe (dstrain/offload)
        return offload.build_offload_optimizer(
            zero.param_groups(),
            zc.offload_optimizer,
            optimizer_config=config.optimizer,
            client=client,
            sub_group_size=zc.sub_group_size,
            pinned_budget=zc.offload_pinned_bytes,
            aio=config.aio,
            zero=zero,  # stage 3 with parameters on NVMe: the master may live in its shard file
            gradient_clipping=config.gradient_clipping,  # with fp16: whether sub-groups may step in backward
            precision=config.precision,
        )
    if client is None and onebit.applies(config):
        return onebit.build_stepper(zero, config)
    if client is None and config.optimizer is None:
        return NoOptimizer()  # DeepSpeed takes a model without one (evaluation); step() says so
    if callable(client) and not isinstance(client, torch.optim.Optimizer):
        made = client(zero.param_groups())
        if isinstance(made, torch.optim.Optimizer):
            return TorchStepper(made)
        if isinstance(made, Stepper):
            return made
        raise TypeError(
            f"optimizer= callable returned {type(made).__name__}: expected a torch optimizer or a dstrain Stepper"
        )
    groups = stepped_groups(zero, config.optimizer, client)  # (LAMB at stage 0: per parameter)
    return TorchStepper(build_optimizer(groups, config.optimizer, client))


ClientScheduler = LRSchedule | torch.optim.lr_scheduler.LRScheduler | Callable[[Any], Any]


def build_schedule(
    stepper: Stepper,
    config: DSConfig,
    client: ClientScheduler | None,
    client_optimizer: ClientOptimizer | None = None,
) -> Any:
    """The LR schedule: the client's (an object, or a callable given the optimizer), or the config's, or none.

    A scheduler object must be bound to the client optimizer passed as ``optimizer=``. That optimizer
    is the one stepped (moved onto the master tensors) except under optimizer offload, where the
    offloading stepper takes its place and the scheduler is bound to it instead.
    """
    optimizer = stepper.optimizer if isinstance(stepper, WrapsOptimizer) else stepper
    if client is not None and optimizer is None:
        raise ConfigError("lr_scheduler", "a scheduler needs an optimizer (this engine has none)")
    if isinstance(client, LRSchedule | torch.optim.lr_scheduler.LRScheduler):
        if client.optimizer is not client_optimizer or client_optimizer is None:
            raise ValueError("lr_scheduler= is bound to another optimizer than the one passed as optimizer=")
        if client.optimizer is not optimizer:  # offload: the stepper replaced the client optimizer
            client.optimizer = optimizer
            if isinstance(client, torch.optim.lr_scheduler.LRScheduler):
                if not isinstance(optimizer, torch.optim.Optimizer):
                    raise TypeError(f"a torch LR scheduler cannot drive {type(optimizer).__name__}")
                # torch checks once that the optimizer's step was wrapped by a scheduler built on it (to
                # warn of a wrong call order); a scheduler that leaves the lrs as they are wraps it
                torch.optim.lr_scheduler.ConstantLR(optimizer, factor=1.0, total_iters=0)
        return client
    if client is not None:
        if not callable(client):
            raise TypeError(
                f"lr_scheduler= must be a scheduler object or a callable taking the optimizer, "
                f"got {type(client).__name__}"
            )
        return client(optimizer)
    if config.scheduler is not None:
        if optimizer is None:
            raise ConfigError("scheduler", "a scheduler needs an optimizer (this config has none)")
        return build_scheduler(optimizer, config.scheduler)
    return None


def _build_loader(
    data: Dataset[Any] | None,
    config: DSConfig,
    topology: Topology,
    collate_fn: Callable[[list[Any]], Any] | None,
) -> DataLoader[Any] | None:
    """A loader of micro-batches, each data-parallel rank reading its own share."""
    if data is None:
        return None
    sampler: DistributedSampler[Any] = DistributedSampler(
        data, num_replicas=topology.dp.world_size, rank=topology.dp.rank, shuffle=True, seed=config.seed or 0
    )
    return DataLoader(
        data,
        batch_size=config.train_micro_batch_size_per_gpu,
        sampler=sampler,
        collate_fn=collate_fn,
        drop_last=config.dataloader_drop_last,
    )


def _default_store(config: DSConfig) -> CheckpointStore:
    """dsio's checkpoints (or the torch.save fallback); per-host directories with node-local storage."""
    if config.checkpoint.use_node_local_storage:
        from dstrain.checkpoint.node_local import NodeLocalStore

        return NodeLocalStore()
    return default_store()


# -- the composer ----------------------------------------------------------------------------------


def initialize(
    args: Any = None,
    model: torch.nn.Module | None = None,
    optimizer: ClientOptimizer | None = None,
    model_parameters: Iterable[Any] | None = None,
    training_data: Dataset[Any] | None = None,
    lr_scheduler: ClientScheduler | None = None,
    config: dict[str, Any] | str | os.PathLike[str] | None = None,
    config_params: dict[str, Any] | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    dist_init_required: bool | None = None,
    checkpoint_store: CheckpointStore | None = None,
) -> tuple[Engine, Any, DataLoader[Any] | None, LRSchedule | None]:
    """DeepSpeed-compatible: returns (engine, optimizer, training dataloader or None, LR schedule or None).

    ``model`` is modified in place: cast to the compute dtype, its trainable parameters moved into flat
    (and, at stage 3, partitioned) storage. ``optimizer`` may be a fresh torch optimizer (its param
    groups, with their options, become ZeRO's groups and it is moved onto the fp32 master tensors;
    ``model_parameters`` is then not used), a callable taking param groups, or None (with no
    ``"optimizer"`` section either, the engine cannot `step`). ``lr_scheduler`` may be a scheduler object
    bound to that optimizer or a callable taking the optimizer. ``args.deepspeed_config`` is read like
    DeepSpeed. The optimizer returned is the torch optimizer (or the `Stepper` when one replaces it,
    or None).
    """
    if model is None:
        raise ValueError("initialize needs model=")
    if config is None:
        config = config_params if config_params is not None else getattr(args, "deepspeed_config", None)
    if config is None:
        raise ValueError("initialize needs config= (a DeepSpeed JSON dict or path)")
    if dist_init_required is not False:
        init_distributed()

    # batch sizes count data-parallel ranks; the config comes before the groups (their timeout)
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    layout = Layout(world=world, pp=pipeline.pipeline_stages(model), ep=moe.expert_parallel_size(model))
    raw = read_config_file(config) if isinstance(config, str | os.PathLike) else config
    raw = resolve_auto(raw, model=model, optimizer=optimizer)  # "auto": bucket sizes from hidden size, ...
    cfg = DSConfig.load(raw, world_size=layout.dp)
    if cfg.dist_timeout is not None:
        set_timeout(cfg.dist_timeout)
    cfg = offload.aligned_sub_groups(
        cfg
    )  # params + optimizer on NVMe: page-aligned sub-groups (dstrain/offload)
    topology = build_topology(model, config)
    experts = moe.applies(cfg, model)  # expert parameters: MoE layers (dstrain/moe)
    if experts:
        moe.bind_expert_groups(model, topology)  # they exchange tokens over topology.ep
    if cfg.seed is not None:
        torch.manual_seed(cfg.seed)
    precision = Precision(cfg.precision, cfg.fp16)
    if cfg.comms_logger is not None:  # every Comm (and MoE's all-to-all) reports to it
        comms_logger.configure(cfg.comms_logger)
    checkpointer = None
    if activation_checkpointing.applies(cfg):  # dstrain.checkpointing.checkpoint follows the section
        checkpointer = activation_checkpointing.build(cfg)

    if isinstance(optimizer, torch.optim.Optimizer):  # its groups, each with its own options (as DeepSpeed)
        model_parameters = client_param_groups(optimizer)
    groups = _param_groups(model, model_parameters)
    if experts:
        groups = moe.split_expert_groups(groups)  # experts: groups of their own
    routes = build_routes(groups, topology, cfg)
    if cfg.zero_optimization.stage != 3:  # a model built under zero.Init: whole again below stage 3
        zero_init.materialize(model)
    _place_and_broadcast(model, groups, routes, topology)
    # a pipeline's tied weights: groups made (and weights made equal) before ZeRO copies them
    piped = pipeline.applies(cfg, model)  # a PipelineModule (dstrain/pipe)
    tied = pipeline.tied_groups(model, topology) if piped else {}
    zero_init.prepare(model, precision.dtype)  # zero.Init's placeholders: cast without materializing
    model.to(precision.dtype)
    zero = build_zero(model, groups, routes, cfg, topology, precision.dtype)
    if zero.stage == 3:  # a transformers model's save_pretrained would write empty placeholders
        guard_save_pretrained(model)
        if zero.partitioned:  # and its generate must keep every rank's forwards (gathers) in step
            default_synced_gpus(model)

    stepper = build_stepper(zero, cfg, optimizer)
    schedule = build_schedule(stepper, cfg, lr_scheduler, optimizer)
    loader = _build_loader(training_data, cfg, topology, collate_fn)
    # a pipeline model: the norm over every stage, and train_batch / eval_batch's 1F1B runner (dstrain/pipe)
    pipe = pipeline.build(model, zero, topology, tied, cfg) if piped else None

    engine = Engine(
        module=model,
        config=cfg,
        topology=topology,
        precision=precision,
        zero=zero,
        stepper=stepper,
        lr_scheduler=schedule,
        store=checkpoint_store or _default_store(cfg),
        # which experts this rank's state holds (dstrain/moe): for every model, a dense one's [] refuses
        # an MoE checkpoint
        parts={"moe": moe.ExpertLayoutPart(model)},
        grad_sets=pipe.grad_sets if pipe is not None else None,
        runner=pipe.runner if pipe is not None else None,
    )
    offload.own_parts(engine)  # dstrain_offload_* carry its labels (rank, engine), as its dstrain_* do
    if checkpointer is not None:
        engine.observers.append(checkpointer)  # closed with the engine (its NVMe swap file)
    if monitors.applies(cfg, model):  # tensorboard / csv_monitor / wandb (dstrain/monitor)
        monitor = monitors.build(cfg, topology.world.rank)
        if monitor is not None:  # rank 0 writes
            engine.observers.append(monitor)
    if flops_profiler.applies(cfg, model):  # flops_profiler (dstrain/profiling)
        # before the monitors: they read the MFU it sets
        engine.observers.insert(0, flops_profiler.build(cfg, model, topology.world.rank))
    lifetime.track(engine)  # closed at exit if the script does not, before the process groups go
    return engine, engine.optimizer, loader, schedule
