"""The offload room's plug: what `initialize` calls. `build_param_store` (stage 3: the shard store
``offload_param`` asks for, or None) inside `build_zero`; `build_offload_optimizer` in
`build_stepper` when `applies` (``offload_optimizer`` is on)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from dstrain.errors import ConfigError, NotImplementedConfigError
from dstrain.offload.config import OffloadOptimizerConfig, check_nvme_path
from dstrain.offload.optimizer.adam import CUT, OffloadAdam
from dstrain.offload.optimizer.early_step import KEY as EARLY_KEY
from dstrain.offload.optimizer.early_step import EarlyStep
from dstrain.offload.optimizer.step_thread import StepThread
from dstrain.zero.base import ReportsUnitReduced
from dstrain.zero.flat import STEP_CHUNK
from dstrain.zero.units import HoldsShards

__all__ = [
    "aligned_sub_groups",
    "applies",
    "build_offload_optimizer",
    "build_param_store",
    "early_step_legal",
    "io_config_from",
    "own_parts",
    "remaining_budget",
]

log = logging.getLogger(__name__)

_FIELD = "zero_optimization.offload_optimizer"


def applies(config: Any, model: torch.nn.Module | None = None) -> bool:
    """Whether the optimizer is offloaded (``zero_optimization.offload_optimizer``): then this room
    builds the stepper (`build_offload_optimizer`)."""
    return bool(config.zero_optimization.offload_optimizer.enabled)


def aligned_sub_groups(config: Any) -> Any:
    """``config`` with ``zero_optimization.sub_group_size`` rounded up to a multiple of `CUT` (1024
    elements, 4 KiB of fp32) where parameters and optimizer state are both on NVMe: the master is
    then stepped in page-aligned pieces of its file. DeepSpeed configs often say 1e6 or 5e6; the size
    is a performance hint, so it is rounded (and logged), not refused. Else ``config`` itself."""
    zc = config.zero_optimization
    both_nvme = zc.offload_param.device == "nvme" and zc.offload_optimizer.device == "nvme"
    size = int(zc.sub_group_size)
    if zc.stage != 3 or not both_nvme or min(size, STEP_CHUNK) % CUT == 0:
        return config
    rounded = -(-size // CUT) * CUT
    log.info(
        "zero_optimization.sub_group_size %d rounded up to %d: with parameters and optimizer state on "
        "NVMe the master is stepped in page-aligned pieces (multiples of %d elements)",
        size,
        rounded,
        CUT,
    )
    zc = dataclasses.replace(zc, sub_group_size=rounded)
    return dataclasses.replace(config, zero_optimization=zc)


def io_config_from(aio: Any) -> Any:
    """dsio's `IOConfig` for the config's ``"aio"`` block (an IOConfig, a parsed section, a dict or None)."""
    from dsio.config import IOConfig
    from dsio.errors import ConfigError as DsioConfigError

    if aio is None or isinstance(aio, IOConfig):
        return aio or IOConfig.from_deepspeed(None)
    block = (
        dataclasses.asdict(aio) if dataclasses.is_dataclass(aio) and not isinstance(aio, type) else dict(aio)
    )
    try:
        return IOConfig.from_deepspeed(block)
    except DsioConfigError as e:
        raise ConfigError(f"aio.{e.field or 'block'}", str(e)) from e


def _adam_settings(optimizer: Any, client: Any, param_groups: list[dict[str, Any]]) -> dict[str, Any]:
    """lr, betas, eps, weight_decay and adamw from the ``"optimizer"`` section or a torch Adam(W).

    These are the defaults; each of ``param_groups`` keeps its own options (a client optimizer's
    groups arrive here with theirs: `dstrain.optim.build.client_param_groups`), and `OffloadAdam`
    steps every group with its own lr / betas / eps / weight decay.
    """
    if client is not None:
        if not isinstance(client, torch.optim.Adam | torch.optim.AdamW):
            raise NotImplementedConfigError(
                _FIELD, f"offloaded optimizers are Adam/AdamW; got {type(client).__name__} from optimizer="
            )
        d = client.defaults
        for i, g in enumerate([d, *param_groups]):
            asked = [k for k in ("amsgrad", "maximize", "differentiable") if g.get(k)]
            if asked:
                where = "optimizer=" if i == 0 else f"param group {i - 1} of optimizer="
                raise NotImplementedConfigError(_FIELD, f"{', '.join(asked)} ({where}) is not offloaded")
        adamw = isinstance(client, torch.optim.AdamW) or bool(d.get("decoupled_weight_decay"))
        if any(bool(g.get("decoupled_weight_decay", adamw)) != adamw for g in param_groups):
            raise NotImplementedConfigError(
                _FIELD,
                "param groups of optimizer= mix decoupled and L2 weight decay; offloaded Adam steps one kind",
            )
        return {
            "lr": float(d["lr"]),
            "betas": tuple(d["betas"]),
            "eps": float(d["eps"]),
            "weight_decay": float(d["weight_decay"]),
            "adamw": adamw,
        }
    if optimizer is None:
        raise ValueError('no optimizer: set "optimizer" in the config or pass optimizer= to initialize')
    name = optimizer.name
    if name not in ("Adam", "AdamW"):
        raise NotImplementedConfigError("optimizer.type", f"{name} cannot be offloaded (Adam and AdamW can)")
    params = dict(optimizer.params)
    if params.get("amsgrad"):
        raise NotImplementedConfigError("optimizer.params.amsgrad", "amsgrad is not offloaded")
    return {
        "lr": float(params.get("lr", 1e-3)),
        "betas": tuple(params.get("betas", (0.9, 0.999))),
        "eps": float(params.get("eps", 1e-8)),
        "weight_decay": float(params.get("weight_decay", 0.0)),
        "adamw": name == "AdamW" or bool(params.get("adam_w_mode", True)),
    }


def build_offload_optimizer(
    param_groups: list[dict[str, Any]],
    offload: OffloadOptimizerConfig,
    *,
    optimizer_config: Any = None,
    client: Any = None,
    sub_group_size: int = 1_000_000_000,
    pinned_budget: int = 1 << 30,
    aio: Any = None,
    zero: Any = None,
    gradient_clipping: float = 0.0,
    precision: str = "fp32",
) -> OffloadAdam:
    """An `OffloadAdam` over the ZeRO strategy's master ``param_groups``, as ``offload`` says.

    Checks ``nvme_path`` (exists, writable; O_DIRECT or a logged fallback) before anything is
    allocated. ``zero``: the strategy; where its parameter store holds the fp32 master (stage 3,
    parameters and optimizer on NVMe), the optimizer reads and writes the master through it, and
    the store's pinned bytes come out of ``pinned_budget``.

    Where legal (`early_step_legal`: stage 3, no clipping, not fp16; with the master or the
    gradients in swap files, pools of at least two buffers) and ``offload.step_in_backward`` is on,
    sub-groups are stepped during the boundary backward as their gradients become final (`dstrain.offload.optimizer.early_step.EarlyStep`);
    with ``offload.step_thread`` on, on a thread of their own
    (`dstrain.offload.optimizer.step_thread.StepThread`), the master and the gradients in memory or
    swapped alike.
    """
    if not offload.enabled:
        raise ValueError("build_offload_optimizer needs offload_optimizer.device 'cpu' or 'nvme'")
    settings = _adam_settings(optimizer_config, client, param_groups)
    if offload.device == "nvme":
        assert offload.nvme_path is not None  # the config requires it
        check_nvme_path(f"{_FIELD}.nvme_path", offload.nvme_path)
    if offload.pin_memory and offload.device == "cpu" and not torch.cuda.is_available():
        log.info("%s.pin_memory: no GPU here, page-locking host state would buy nothing; not pinned", _FIELD)
    store = zero.store if isinstance(zero, HoldsShards) else None
    master_store = store.master if store is not None and store.holds_master else None
    if master_store is not None:
        sub_group_size = min(int(sub_group_size), master_store.max_master_numel)
    grad_store = store.grads if store is not None else None  # on NVMe: the budget could not hold them
    if grad_store is not None:
        sub_group_size = min(int(sub_group_size), grad_store.max_numel)
    optimizer = OffloadAdam(
        param_groups,
        master_store=master_store,
        grad_store=grad_store,
        device=offload.device,
        sub_group_size=int(sub_group_size),  # JSON may say 1e9
        nvme_path=offload.nvme_path,
        buffer_count=int(offload.buffer_count),
        pinned_budget=remaining_budget(zero, int(pinned_budget)),
        io_config=io_config_from(aio) if offload.device == "nvme" else None,
        # device "cpu": Adam's m/v in page-locked memory where a GPU copies them (nvme: the swap
        # buffers are dsio's pinned pool either way)
        pin_memory=offload.pin_memory and offload.device == "cpu" and torch.cuda.is_available(),
        **settings,
    )
    why_not = early_step_legal(offload, zero, gradient_clipping, precision)
    masters = grads = 0
    if why_not is None and master_store is not None:
        masters = master_store.lend_master_buffers()  # the shard pool's spare buffers, in backward
        if masters < 1:
            why_not = "the parameter swap pool has one buffer: the gathers need it during backward"
    if why_not is None and grad_store is not None:
        grads = grad_store.buffers - 1  # one stays for the accumulation of each reduced unit
        if grads < 1:
            why_not = "the gradient swap pool has one buffer: the accumulation needs it during backward"
    if why_not is None:
        # the host step (and its write-backs) off the backward thread; with the master or the
        # gradients swapped their reads stay on the backward thread
        thread = StepThread() if offload.step_thread else None
        optimizer.attach_early_step(EarlyStep(optimizer, zero), masters=masters, grads=grads, thread=thread)
    else:
        log.info("%s: sub-groups are stepped in engine.step(), not during backward: %s", _FIELD, why_not)
    return optimizer


def early_step_legal(
    offload: OffloadOptimizerConfig, zero: Any, gradient_clipping: float, precision: str
) -> str | None:
    """None when sub-groups may be stepped during backward, else why not (logged). A master or
    gradients in swap files are read during backward too (`OffloadAdam.attach_early_step`)."""
    if not offload.step_in_backward:
        return f"{EARLY_KEY} is false"
    if not isinstance(zero, ReportsUnitReduced):
        return "only ZeRO stage 3 reduces each unit's gradient during backward"
    if gradient_clipping > 0:
        return "gradient_clipping needs the global norm of every gradient first"
    if precision == "fp16":
        return "fp16's overflow check needs every gradient first"
    return None


def build_param_store(zero_config: Any, dtype: torch.dtype, aio: Any = None) -> Any:
    """The stage-3 `ShardStore` ``offload_param`` asks for (`OffloadedShards`); with the optimizer alone
    offloaded (``offload_optimizer.device`` "cpu" or "nvme", parameters not), `HostMasterShards` (the
    fp32 master and gradients in host memory); else None (resident).

    With the optimizer on NVMe the master stays in host memory rather than in a swap file of its own
    (DeepSpeed swaps it with m and v): what the GPU saves is the same (the device keeps the
    half-precision shards), host memory is bounded by the model at 8 bytes a parameter (master and
    gradients, which live there either way), and each step's disk traffic stays m and v (8 bytes a
    parameter each way) instead of 12. A model whose master does not fit in host memory offloads its
    parameters too (``offload_param.device: "nvme"``): then the master is in the parameter file.

    Checks ``nvme_path`` first. The pinned budget is shared: the parameter pool takes half of
    ``offload_pinned_bytes`` when optimizer state is swapped too, else all of it; the optimizer gets
    what the parameter pool did not allocate (`remaining_budget`).
    """
    param = zero_config.offload_param
    if not param.enabled:
        if zero_config.offload_optimizer.enabled:  # ZeRO-Offload / -Infinity: master + gradients on the host
            from dstrain.offload.param.host_master import HostMasterShards

            return HostMasterShards(pin_memory=zero_config.offload_optimizer.pin_memory)
        return None
    from dstrain.offload.param.shards import OffloadedShards

    if param.device == "nvme":
        assert param.nvme_path is not None  # the config requires it
        check_nvme_path("zero_optimization.offload_param.nvme_path", param.nvme_path)
    both_nvme = param.device == "nvme" and zero_config.offload_optimizer.device == "nvme"
    holds_master = both_nvme  # the fp32 master in a file too (the shard file at fp32, its own otherwise)
    if holds_master and min(int(zero_config.sub_group_size), STEP_CHUNK) % CUT:
        raise ConfigError(
            "zero_optimization.sub_group_size",
            f"with parameters and optimizer state on NVMe the master is stepped in page-aligned "
            f"pieces: use a multiple of {CUT} (got {zero_config.sub_group_size}; initialize rounds it, "
            "`aligned_sub_groups`)",
        )
    budget = zero_config.offload_pinned_bytes // 2 if both_nvme else zero_config.offload_pinned_bytes
    return OffloadedShards(
        param.device,
        dtype=dtype,
        nvme_path=param.nvme_path,
        pinned_budget=budget,
        buffer_count=int(param.buffer_count),
        buffer_size=int(param.buffer_size),
        pin_memory=param.pin_memory,
        # optimizer state on NVMe: OffloadAdam swaps the master from its file (at fp32: the shard file)
        holds_master=holds_master,
        io_config=io_config_from(aio) if param.device == "nvme" else None,
        # both on NVMe: the gradient shards follow when the budget cannot hold them (OffloadedGrads)
        host_budget=zero_config.offload_pinned_bytes if both_nvme else None,
    )


def own_parts(engine: Any) -> None:
    """Hand ``engine`` the offload parts it was composed with (its `OffloadAdam`; stage 3's
    `OffloadedShards` and their gradient file): their ``dstrain_offload_*`` series are the engine's
    from then on, labelled and exported as its ``dstrain_*`` ones (`dstrain.offload.metrics.own`).
    Nothing for an engine without them."""
    from dstrain.offload.metrics import own
    from dstrain.offload.param.shards import OffloadedShards

    parts: list[Any] = [engine.stepper] if isinstance(engine.stepper, OffloadAdam) else []
    store = engine.zero.store if isinstance(engine.zero, HoldsShards) else None
    if isinstance(store, OffloadedShards):
        parts += [store] if store.grads is None else [store, store.grads]
    for part in parts:
        own(part, engine)


def remaining_budget(zero: Any, budget: int) -> int:
    """``budget`` less the pinned bytes the ZeRO strategy's parameter store allocated."""
    store = zero.store if isinstance(zero, HoldsShards) else None
    return budget - (store.pinned_bytes if store is not None else 0)
