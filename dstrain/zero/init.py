"""``zero.Init``: partition every module's parameters as soon as the module is built.

    with dstrain.zero.Init(config_dict_or_path=cfg, remote_device="nvme"):
        model = GPT(config)          # never more than the largest module whole in memory
    engine, *_ = dstrain.initialize(model=model, config=cfg)   # adopts the shards as they are

Contract: a partitioned parameter keeps its shape and dtype but holds one broadcast element (read
and change whole values with `GatheredParameters`); values and RNG stream are bitwise those of the
model built without Init; ``initialize`` adopts a unit's shard as it is where the unit is exactly
one Init unit, else gathers it back first (`materialize`); `InitError` refuses non-floating and
meta parameters. The design, in full: docs/zero.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import threading
import uuid
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from dstrain.dist.comm import Comm
from dstrain.errors import ConfigError, InitError, InsufficientDiskError
from dstrain.zero.flat import FlatLayout

__all__ = [
    "GatheredParameters",
    "Init",
    "InitStatistics",
    "InitUnit",
    "AdoptedShard",
    "adopt",
    "external_parameters",
    "is_partitioned",
    "materialize",
    "prepare",
    "register_external_parameter",
]

log = logging.getLogger(__name__)

_NVME_KEY = "zero_optimization.offload_param.nvme_path"
_ALIGN = 4096
#: Pinned staging pool of the Init swap file's handle (the partial pages of unaligned transfers).
_POOL_BYTES = 1 << 20
#: Bytes left free on the swap filesystem beyond the shards themselves (metadata, other files).
DISK_RESERVE = 64 << 20

# -- registries (weak: a parameter dropped by its model frees its shard) ---------------------------
_unit_of: WeakIdKeyDictionary = WeakIdKeyDictionary()  # Parameter -> InitUnit
_module_unit: WeakIdKeyDictionary = WeakIdKeyDictionary()  # Module -> InitUnit built for it
_external: WeakIdKeyDictionary = WeakIdKeyDictionary()  # Module -> list of Parameters it also uses
_lock = threading.RLock()
_active: list[Init] = []  # the innermost active context last


def is_partitioned(param: torch.Tensor) -> bool:
    """Whether ``param`` is held as a shard by a `zero.Init` unit (not adopted by an engine yet)."""
    return param in _unit_of


def free_bytes(path: str) -> int:
    """Bytes available to this user on the filesystem holding ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


_PUNCH_HOLE, _KEEP_SIZE = 0x02, 0x01
try:
    _fallocate: Any = ctypes.CDLL(None, use_errno=True).fallocate
    _fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long)
except (OSError, AttributeError):  # pragma: no cover - another libc
    _fallocate = None


class _SwapFile:
    """One rank's Init shards on NVMe: page-aligned regions of one file, written and read through
    dsio on its loop thread. The file is removed when the last unit holding a region goes."""

    def __init__(self, directory: str, rank: int, aio: Any = None) -> None:
        from dsio import AsyncIOHandle, IOConfig

        self.directory = directory
        self.path = os.path.join(directory, f"zero_init_rank{rank}_{os.getpid()}_{uuid.uuid4().hex[:8]}.swp")
        self.end = 0
        self.written = 0
        # the config's "aio" section (already an IOConfig), else DeepSpeed's defaults; a small pinned
        # pool: shards are written once, from page-aligned buffers (`_aligned`), so staging is rare
        cfg = aio if aio is not None else IOConfig.from_deepspeed(None)
        self._handle = AsyncIOHandle(replace(cfg, pool_bytes=_POOL_BYTES, staging_buffer_bytes=_POOL_BYTES))
        self._file: Any = None
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        os.close(fd)
        self._finalizer = weakref.finalize(self, _SwapFile._remove, self.path, self._handle)

    @staticmethod
    def _remove(path: str, handle: Any) -> None:
        from dsio import is_exiting, run_sync

        if not is_exiting():
            with contextlib.suppress(Exception):  # a loop closed at exit: nothing left to flush
                run_sync(handle.aclose())
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def _run(self, coro: Any) -> Any:
        from dsio import run_sync

        return run_sync(coro)

    def write(self, shard: torch.Tensor, module: str) -> int:
        """Append ``shard`` at a page-aligned offset; return the offset."""
        nbytes = shard.numel() * shard.element_size()
        region = -(-nbytes // _ALIGN) * _ALIGN
        free = free_bytes(self.directory)
        if region + DISK_RESERVE > free:
            raise InsufficientDiskError(
                self.directory, region + DISK_RESERVE, free, what=f"zero.Init's shard of {module}"
            )
        offset = self.end
        self.end += region
        self.write_at(offset, shard)
        self.written += nbytes
        return offset

    def write_at(self, offset: int, shard: torch.Tensor) -> None:
        if not shard.numel():
            return

        async def put() -> None:
            f = self._handle.open(self.path, "r+")
            try:
                await f.pwrite(shard.contiguous(), offset)
            finally:
                f.close()

        self._run(put())

    def read(self, offset: int, out: torch.Tensor) -> None:
        if not out.numel():
            return

        async def get() -> None:
            f = self._handle.open(self.path, "r")
            try:
                await f.pread(out, offset)
            finally:
                f.close()

        self._run(get())

    def punch(self, offset: int, nbytes: int) -> None:
        """Give the disk blocks of ``[offset, offset + nbytes)`` back (a unit the engine adopted),
        so that Init's file and the engine's swap files never both hold the whole model."""
        region = -(-nbytes // _ALIGN) * _ALIGN
        if region == 0 or _fallocate is None:
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        try:
            _fallocate(fd, _PUNCH_HOLE | _KEEP_SIZE, offset, region)  # best effort: ext4, xfs, tmpfs do it
        finally:
            os.close(fd)

    def remove(self) -> None:
        self._finalizer()


class InitUnit:
    """One module's parameters partitioned together: this rank's shard of their padded flat layout,
    in memory (``shard``) or in a swap file (``swap`` at ``offset``)."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        layout: FlatLayout,
        comm: Comm,
        dtype: torch.dtype,
        device: torch.device,
        module: str,
    ) -> None:
        # a parameter dropped by the model (a tied weight's replaced original) frees the shard once
        # none of the unit's parameters is left
        self._params = [weakref.ref(p, self._param_gone) for p in params]
        self.layout = layout
        self.comm = comm
        self.dtype = dtype
        self.device = device
        self.module = module
        self.shard: torch.Tensor | None = None
        self.swap: _SwapFile | None = None
        self.offset = 0
        self.where = "device"

    def _param_gone(self, _ref: Any) -> None:
        if all(r() is None for r in self._params):
            self.shard = None
            self.swap = None

    @property
    def params(self) -> list[torch.nn.Parameter]:
        """The unit's parameters still alive (a replaced tied parameter may be gone)."""
        return [p for p in (r() for r in self._params) if p is not None]

    def members(self) -> list[torch.nn.Parameter | None]:
        """The unit's parameters in layout order (None where one is gone)."""
        return [r() for r in self._params]

    def overwrite(self, fill: Callable[[list[tuple[int, int, torch.Tensor]]], None]) -> None:
        """Rewrite this rank's shard in place: ``fill(pieces)`` fills each ``(index, start, out)``:
        elements ``[start, start + out.numel())`` of member ``index`` into ``out`` (a view of the
        shard, or of a one-shard buffer written back to the swap file after)."""
        if self.shard is None and self.swap is None:
            raise RuntimeError(f"the zero.Init shard of {self.module} was released")
        lay = self.layout
        buf = self.shard if self.swap is None else torch.zeros(lay.shard, dtype=self.dtype)
        assert buf is not None
        pieces = []
        for i in range(len(self._params)):
            span = lay.overlap(i)
            if span is not None:
                lo, hi = span
                pieces.append((i, lo - lay.offsets[i], buf[lo - lay.lo : hi - lay.lo]))
        fill(pieces)
        if self.swap is not None:
            self.swap.write_at(self.offset, buf)

    def same_params(self, params: list[torch.nn.Parameter]) -> bool:
        mine = [r() for r in self._params]
        return len(mine) == len(params) and all(a is b for a, b in zip(mine, params, strict=True))

    def flatten(self) -> torch.Tensor:
        """The parameters' current (whole) values in the padded flat layout (a dead one: zeros)."""
        flat = torch.zeros(self.layout.padded, dtype=self.dtype, device=self.device)
        for ref, off, n in zip(self._params, self.layout.offsets, self.layout.numels, strict=True):
            p = ref()
            if p is not None:
                flat[off : off + n].copy_(p.data.reshape(-1))
        return flat

    @property
    def shard_bytes(self) -> int:
        return self.layout.shard * torch.empty((), dtype=self.dtype).element_size()

    def read_shard(
        self, dtype: torch.dtype | None = None, device: torch.device | None = None
    ) -> torch.Tensor:
        """A new tensor holding this rank's shard ``(layout.shard,)`` (converted to ``dtype``)."""
        if self.swap is not None:
            out = torch.empty(self.layout.shard, dtype=self.dtype)
            self.swap.read(self.offset, out)
        else:
            assert self.shard is not None
            out = self.shard
        return out.to(device=device or self.device, dtype=dtype or self.dtype)

    def restore(self, full: torch.Tensor) -> None:
        """Give the parameters whole values again: views of ``full`` (padded flat)."""
        for ref, view in zip(self._params, self.layout.views(full), strict=True):
            p = ref()
            if p is not None:
                p.data = view

    def gather(self) -> torch.Tensor:
        """The whole padded flat values ``(layout.padded,)`` (a collective over ``comm``)."""
        shard = self.read_shard()
        full = torch.empty(self.layout.padded, dtype=self.dtype, device=shard.device)
        self.comm.all_gather(full, shard)
        return full

    def release(self) -> None:
        """Drop the shard (memory or its swap region) and forget the parameters."""
        self.shard = None
        swap, self.swap = self.swap, None
        if swap is not None:
            swap.punch(self.offset, self.shard_bytes)
        del swap  # the file goes with the last unit that holds a region of it
        for p in self.params:
            if _unit_of.get(p) is self:
                del _unit_of[p]


def _aligned(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Zeros ``(numel,)`` starting on a page boundary (dsio writes them with O_DIRECT, unstaged)."""
    esize = torch.empty((), dtype=dtype).element_size()
    raw = torch.zeros(numel * esize + _ALIGN, dtype=torch.uint8)
    s = (-raw.data_ptr()) % _ALIGN
    return raw[s : s + numel * esize].view(dtype)


def _placeholder(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of ``shape`` that holds one element (writes through it are refused by torch)."""
    return torch.zeros((), dtype=dtype, device=device).expand(shape)


@dataclass(frozen=True, slots=True)
class InitStatistics:
    """What one `Init` block partitioned on this rank."""

    units: int
    params: int
    numel: int
    """Elements of the partitioned parameters (whole, all ranks)."""
    shard_bytes: dict[str, int]
    """Bytes of this rank's shards by where they are: ``device``, ``cpu``, ``nvme``."""
    largest_module_numel: int
    """The most parameter elements one module held whole at its partitioning (the construction peak)."""
    swap_file: str | None
    released: bool
    """True after a failed construction freed everything."""


class Init:
    """Partition parameters as modules are built (DeepSpeed's ``deepspeed.zero.Init``).

    ``config_dict_or_path``: the DeepSpeed config (dict or JSON path) that ``initialize`` will get;
    it supplies ``dtype`` (bf16 / fp16 / fp32) and, for NVMe, ``offload_param.nvme_path``.
    ``remote_device``: ``None`` (the config's ``offload_param.device``, else the parameters' own
    device), ``"cpu"`` or ``"nvme"``. ``pin_memory``: page-lock host shards (CUDA only).
    ``dtype``: the dtype of the shards (default: the config's training dtype). ``enabled=False``
    builds the model normally. ``comm``: the partitioning group (default: the world).
    """

    def __init__(
        self,
        module: torch.nn.Module | None = None,
        data_parallel_group: Any = None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path: Mapping[str, Any] | str | os.PathLike[str] | None = None,
        config: Mapping[str, Any] | str | os.PathLike[str] | None = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu: Any = None,
        *,
        comm: Comm | None = None,
    ) -> None:
        self.enabled = enabled
        self._units: list[InitUnit] = []
        self._largest = 0
        self._released = False
        self._patched: dict[type, Any] = {}
        self._old_subclass_hook: Any = None
        self._swap: _SwapFile | None = None
        if not enabled:
            return
        if module is not None:
            raise InitError(type(module).__name__, "zero.Init(module=...) of a built model is not supported")
        if mpu is not None or data_parallel_group is not None:
            raise ConfigError("zero.Init", "mpu / data_parallel_group: pass comm= (a dstrain Comm) instead")
        cfg_src = config_dict_or_path if config_dict_or_path is not None else config
        self.comm = comm if comm is not None else Comm()
        nvme_path, param_device, cfg_dtype, self._aio = self._read_config(cfg_src)
        if remote_device is None:
            remote_device = param_device if param_device in ("cpu", "nvme") else "none"
        if remote_device not in ("none", "cpu", "nvme"):
            raise ConfigError(
                "zero.Init.remote_device", f"expected None, 'cpu' or 'nvme'; got {remote_device!r}"
            )
        self.remote_device = remote_device
        if remote_device == "nvme":
            if nvme_path is None:
                raise ConfigError(
                    _NVME_KEY, 'zero.Init(remote_device="nvme") needs a directory for the swap files'
                )
            from dstrain.offload.config import check_nvme_path

            check_nvme_path(_NVME_KEY, nvme_path)
        self.nvme_path = nvme_path
        self.pin_memory = bool(pin_memory) and torch.cuda.is_available()
        if pin_memory and not self.pin_memory:
            log.info("zero.Init(pin_memory=True): no GPU here, page-locking would buy nothing; not pinned")
        self.dtype = dtype if dtype is not None else cfg_dtype

    def _read_config(self, src: Any) -> tuple[str | None, str, torch.dtype, Any]:
        if src is None:
            return None, "none", torch.float32, None
        from dstrain.config import DSConfig

        cfg = DSConfig.load(src, world_size=self.comm.world_size)
        param = cfg.zero_optimization.offload_param
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision, torch.float32)
        path = param.nvme_path or cfg.zero_optimization.offload_optimizer.nvme_path
        return (os.fspath(path) if path is not None else None), param.device, dtype, cfg.aio

    # -- the context ------------------------------------------------------------------------

    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        with _lock:
            _active.append(self)
            if len(_active) == 1:
                self._patch()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if not self.enabled:
            return
        with _lock:
            _active.remove(self)
            if self._patched:
                self._unpatch()
        if exc_type is not None:
            self.release()
        self._swap = None  # the units hold the file now: it goes with the last of them

    def release(self) -> None:
        """Free every shard this block made (memory, swap file) and the partitioned parameters'
        values: what a construction that failed halfway leaves behind."""
        for unit in self._units:
            for p in unit.params:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            unit.release()
        self._units.clear()
        if self._swap is not None:
            self._swap.remove()
            self._swap = None
        self._released = True

    def _patch(self) -> None:
        for cls in _subclasses(torch.nn.Module):
            self._wrap(cls)
        base = torch.nn.Module
        self._old_subclass_hook = base.__dict__.get("__init_subclass__")
        ctx = self

        def init_subclass(cls: type, **kwargs: Any) -> None:
            super(base, cls).__init_subclass__(**kwargs)  # type: ignore[misc]
            ctx._wrap(cls)

        setattr(base, "__init_subclass__", classmethod(init_subclass))  # noqa: B010

    def _unpatch(self) -> None:
        for cls, orig in self._patched.items():
            cls.__init__ = orig  # type: ignore[misc]
        self._patched.clear()
        if self._old_subclass_hook is None:
            del torch.nn.Module.__init_subclass__
        else:  # pragma: no cover - torch defines none today
            setattr(torch.nn.Module, "__init_subclass__", self._old_subclass_hook)  # noqa: B010

    def _wrap(self, cls: type) -> None:
        orig = cls.__dict__.get("__init__")
        if orig is None or cls in self._patched:
            return
        self._patched[cls] = orig
        cls.__init__ = _wrapped_init(orig)  # type: ignore[misc]

    # -- partitioning -----------------------------------------------------------------------

    def _built(self, module: torch.nn.Module) -> None:
        """``module``'s outermost ``__init__`` returned: partition what its subtree left whole."""
        names = {id(m): n for n, m in module.named_modules()}
        for sub in module.modules():
            direct = [p for p in sub.parameters(recurse=False)]
            fresh = [p for p in direct if p not in _unit_of]
            if not fresh:
                continue
            label = _label(sub, names.get(id(sub), ""))
            old = _module_unit.get(sub)
            if old is not None and any(p in _unit_of and _unit_of[p] is old for p in direct):
                # parameters assigned to ``sub`` after it was built: its unit is rebuilt with them
                old.restore(old.gather())
                old.release()
                self._units.remove(old)
                fresh = [p for p in direct if p not in _unit_of]
            self._partition(sub, fresh, label)

    def _partition(self, module: torch.nn.Module, params: list[torch.nn.Parameter], label: str) -> None:
        for p in params:
            if not p.dtype.is_floating_point:
                raise InitError(
                    label, f"parameter of dtype {p.dtype} cannot be partitioned (floating point only)"
                )
            if p.device.type == "meta":
                raise InitError(label, "parameters on the meta device have no values to partition")
        device = params[0].device
        layout = FlatLayout(params, self.comm.world_size, self.comm.rank)
        self._largest = max(self._largest, layout.total)
        with torch.no_grad():
            if self.comm.world_size > 1:  # every rank holds rank 0's model, as initialize makes it
                for p in params:
                    data = p.data if p.data.is_contiguous() else p.data.contiguous()
                    self.comm.broadcast(data, src=0)
                    p.data = data
            shard = (
                _aligned(layout.shard, self.dtype)
                if self.remote_device == "nvme" and device.type == "cpu"
                else torch.zeros(layout.shard, dtype=self.dtype, device=device)
            )
            for i, p in enumerate(params):
                span = layout.overlap(i)
                if span is not None:
                    lo, hi = span
                    off = layout.offsets[i]
                    shard[lo - layout.lo : hi - layout.lo].copy_(p.data.reshape(-1)[lo - off : hi - off])
        unit = InitUnit(params, layout, self.comm, self.dtype, device, label)
        if self.remote_device == "nvme":
            if self._swap is None:
                assert self.nvme_path is not None
                self._swap = _SwapFile(self.nvme_path, self.comm.rank, self._aio)
            unit.offset = self._swap.write(shard, label)
            unit.swap = self._swap
            unit.where = "nvme"
        elif self.remote_device == "cpu":
            unit.shard = shard.cpu().pin_memory() if self.pin_memory else shard.cpu()
            unit.where = "cpu"
        else:
            unit.shard = shard
        del shard
        for p in params:
            p.data = _placeholder(p.shape, self.dtype, device)
            _unit_of[p] = unit
        _module_unit[module] = unit
        self._units.append(unit)

    def statistics(self) -> InitStatistics:
        where: dict[str, int] = {"device": 0, "cpu": 0, "nvme": 0}
        live = [u for u in self._units if u.shard is not None or u.swap is not None]
        for u in live:
            where[u.where] += u.shard_bytes
        return InitStatistics(
            units=len(live),
            params=sum(len(u.params) for u in live),
            numel=sum(u.layout.total for u in live),
            shard_bytes=where,
            largest_module_numel=self._largest,
            swap_file=self._swap.path if self._swap is not None else None,
            released=self._released,
        )


def _label(module: torch.nn.Module, name: str) -> str:
    return f"{type(module).__name__} {name!r}" if name else type(module).__name__


def _subclasses(cls: type) -> Iterator[type]:
    seen: set[type] = set()
    todo = [cls]
    while todo:
        c = todo.pop()
        subs: list[type] = type.__subclasses__(c)
        for sub in subs:
            if sub not in seen:
                seen.add(sub)
                todo.append(sub)
                yield sub


_building: dict[int, int] = {}  # id(module) -> depth of __init__ calls in progress


def _wrapped_init(orig: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(orig)
    def __init__(self: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        key = id(self)
        depth = _building.get(key, 0)
        _building[key] = depth + 1
        try:
            orig(self, *args, **kwargs)
        finally:
            if depth:
                _building[key] = depth
            else:
                del _building[key]
        if not depth and _active:
            _active[-1]._built(self)

    return __init__


# -- used by Stage3Zero and initialize (the engine's side) -----------------------------------------


def prepare(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Before ``initialize`` casts ``module`` to ``dtype``: placeholders of partitioned parameters
    take that dtype (casting a placeholder would allocate the whole tensor); the shards are
    converted when adopted."""
    for p in module.parameters():
        if p in _unit_of and p.dtype != dtype:
            p.data = _placeholder(p.shape, dtype, p.device)


class AdoptedShard:
    """An Init unit's shard handed to a stage-3 `Unit`: `read` it (as often as the store needs,
    in the engine's dtype, on the unit's device), then `release` it (memory or swap region freed)."""

    def __init__(self, unit: InitUnit, dtype: torch.dtype, device: torch.device) -> None:
        self._unit: InitUnit | None = unit
        self.dtype = dtype
        self.device = device

    def read(self) -> torch.Tensor:
        if self._unit is None:
            raise RuntimeError("the zero.Init shard was released already")
        return self._unit.read_shard(self.dtype, self.device)

    def release(self) -> None:
        unit, self._unit = self._unit, None
        if unit is not None:
            unit.release()


def adopt(params: list[torch.nn.Parameter], comm: Comm, dtype: torch.dtype) -> AdoptedShard | None:
    """For a stage-3 unit of ``params`` partitioned over ``comm``: this rank's shard as Init kept it,
    when the parameters are exactly one Init unit's (same objects, order and group size/rank); else
    None, after gathering any Init unit among them back into whole values (a collective)."""
    units = list(dict.fromkeys(_unit_of[p] for p in params if p in _unit_of))
    if not units:
        return None
    unit = units[0]
    if (
        len(units) == 1
        and unit.same_params(params)
        and comm.world_size == unit.comm.world_size
        and comm.rank == unit.comm.rank
    ):
        for p in params:  # adopted: no longer Init's
            del _unit_of[p]
        return AdoptedShard(unit, dtype, params[0].device)
    for u in units:
        _materialize_unit(u, dtype)
    return None


def _materialize_unit(unit: InitUnit, dtype: torch.dtype | None = None) -> None:
    full = unit.gather()
    if dtype is not None and full.dtype != dtype:
        full = full.to(dtype)
    log.info("zero.Init: %s gathered whole again (its partitioning does not match the engine's)", unit.module)
    unit.restore(full)
    unit.release()


def materialize(module: torch.nn.Module, dtype: torch.dtype | None = None) -> int:
    """Gather every still-partitioned parameter of ``module`` back into whole values (in module
    order; a collective: every rank calls it); return how many units were gathered."""
    units = list(dict.fromkeys(_unit_of[p] for p in module.parameters() if p in _unit_of))
    for u in units:
        _materialize_unit(u, dtype)
    return len(units)


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """``module``'s forward uses ``parameter`` of another module: ZeRO-3 gathers it for ``module``
    too (DeepSpeed's ``register_external_parameter``)."""
    if not isinstance(parameter, torch.nn.Parameter):
        raise TypeError(
            f"register_external_parameter needs a torch.nn.Parameter, got {type(parameter).__name__}"
        )
    items = _external.setdefault(module, [])
    if not any(p is parameter for p in items):
        items.append(parameter)


def external_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters registered with `register_external_parameter` for ``module``."""
    return list(_external.get(module, ()))


class GatheredParameters:
    """Whole values of partitioned parameters inside the block (DeepSpeed's ``GatheredParameters``).

    ``params``: one parameter or an iterable of them; parameters not partitioned are left alone.
    Every rank of the group must enter the block (it is a collective), with the same parameters.

    - Parameters partitioned by `Init` (before ``initialize``) are gathered into whole tensors.
    - Parameters of an engine's ZeRO-3 units (after ``initialize``) are gathered in place: they are
      the units' own buffers, as in forward. Use the block between optimizer steps, and after
      ``engine.wait_checkpoint()`` when an asynchronous save may still be reading the weights.

    ``modifier_rank`` (a global rank): on exit, that rank's values are broadcast and every rank
    keeps its partition of them; after ``initialize`` that is the shard *and* the fp32 master,
    wherever the store keeps them (device, host memory, NVMe swap files), so the next step starts
    from them and the optimizer's step does not overwrite them. At bf16/fp16 the master takes the
    half-precision values (as ``initialize`` makes it from a half-precision model). Other ranks'
    changes are discarded. Change the values in place (``p.data.normal_()``, ``p[0] = ...``) or
    assign a tensor of the same shape to ``p.data``; optimizer state (Adam's m, v) is not touched.
    ``modifier_rank=None``: read-only: changes on every rank are discarded on exit (a unit that
    stays gathered, persistent ones, is gathered again from the unchanged shards).
    An exception inside the block discards changes too.
    """

    def __init__(
        self, params: Any, modifier_rank: int | None = None, fwd_module: Any = None, enabled: bool = True
    ) -> None:
        self.enabled = enabled
        self.modifier_rank = modifier_rank
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params: list[torch.nn.Parameter] = list(params) if params is not None else []
        self._init_units: list[InitUnit] = []
        self._engine_units: list[Any] = []

    def __enter__(self) -> GatheredParameters:
        if not self.enabled:
            return self
        from dstrain.zero.units import unit_of

        self._init_units = list(dict.fromkeys(_unit_of[p] for p in self.params if p in _unit_of))
        self._engine_units = list(
            dict.fromkeys(u for u in (unit_of(p) for p in self.params) if u is not None)
        )
        for u in self._engine_units:
            if self.modifier_rank is not None:
                _group_rank(u.comm, self.modifier_rank)  # refused before any collective
        for u in self._init_units:
            u.restore(u.gather())
        for u in self._engine_units:
            u.finish_gather(private=True)  # a copy of its own: what the block takes stays valid
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if not self.enabled:
            return
        modify = self.modifier_rank is not None and exc_type is None
        wrong: list[str] = []
        for u in self._engine_units:
            wrong += _rebind(u, keep=modify and u.comm.rank == _group_rank(u.comm, self.modifier_rank))
            if modify:
                assert self.modifier_rank is not None
                u.commit(_group_rank(u.comm, self.modifier_rank))
            u.release(between_steps=True)  # tensors taken inside the block (p.data, state_dict()) stay valid
            if not modify and u.gathered:  # stays gathered (persistent): back to the shards' values
                u.regather()
        for u in self._init_units:
            params = u.params
            if modify:
                assert self.modifier_rank is not None
                with torch.no_grad():
                    flat = u.flatten()
                    u.comm.broadcast(flat, src=self.modifier_rank)
                    shard = flat[u.layout.lo : u.layout.hi].clone()
                _rewrite(u, shard)
            for p in params:
                p.data = _placeholder(p.shape, p.dtype, p.device)
        if wrong and exc_type is None:  # after the collectives: the other ranks are not left waiting
            raise InitError(
                "GatheredParameters",
                "a parameter of an engine's ZeRO-3 unit was given a tensor of another shape or dtype "
                f"({'; '.join(wrong)}); its values were not written back (resize before dstrain.initialize)",
            )


def _group_rank(comm: Comm, rank: int | None) -> int:
    """The rank in ``comm``'s group of global rank ``rank`` (InitError when it is not a member)."""
    for i in range(comm.world_size):
        if comm.global_rank(i) == rank:
            return i
    raise InitError(
        "GatheredParameters",
        f"modifier_rank={rank} is not a rank of the parameters' group (ranks "
        f"{[comm.global_rank(i) for i in range(comm.world_size)]})",
    )


def _rebind(unit: Any, keep: bool) -> list[str]:
    """Make ``unit``'s parameters views of its full buffer again where ``p.data`` was assigned in
    the block; with ``keep`` (this rank's values are written back) copy the assigned values first,
    and return a description of each assigned tensor of another shape or dtype (not copied)."""
    wrong = []
    with torch.no_grad():
        for p, view in zip(unit.params, unit.layout.views(unit.full), strict=True):
            if p.data_ptr() == view.data_ptr() and p.shape == view.shape and p.dtype == view.dtype:
                continue  # still the unit's view (changed in place, or not at all)
            if not keep:  # another rank's values are written back: this rank's change goes
                pass
            elif p.shape != view.shape or p.dtype != view.dtype:
                wrong.append(f"{tuple(p.shape)} {p.dtype} for {tuple(view.shape)} {view.dtype}")
            else:
                view.copy_(p.data)
            p.data = view
    return wrong


def _rewrite(unit: InitUnit, shard: torch.Tensor) -> None:
    """Replace ``unit``'s stored shard with ``shard`` (where the unit keeps it)."""
    if unit.swap is not None:
        unit.swap.write_at(unit.offset, shard)
    else:
        assert unit.shard is not None
        unit.shard.copy_(shard)


def partitioned_units(params: Iterable[torch.nn.Parameter]) -> list[InitUnit]:
    """The Init units holding any of ``params`` (in order of first appearance)."""
    return list(dict.fromkeys(_unit_of[p] for p in params if p in _unit_of))
