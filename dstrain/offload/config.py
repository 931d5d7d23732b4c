"""ZeRO-Infinity offload settings: DeepSpeed's ``offload_optimizer`` / ``offload_param`` objects.

DeepSpeed's keys and defaults, parsed strictly (a typo is a `ConfigError` with a did-you-mean).
Where DeepSpeed silently downgrades (``"nvme"`` treated as ``"cpu"`` at stages 1-2) or asserts
(too few pipelined buffers), dstrain either does what was asked or refuses with an error naming
the key.

One dstrain extension: ``zero_optimization.offload_pinned_bytes``, the budget of pinned host
memory for every swap buffer (optimizer and parameters together, including dsio's staging
buffers). Buffer counts and sizes derive from it; DeepSpeed's ``buffer_count`` and
``buffer_size`` are hints that the budget overrides (logged), never a reason to assert.
"""

from __future__ import annotations

import errno
import logging
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from dstrain._parse import Section, Unbuilt, build, check_bool, check_choice, check_float, check_int
from dstrain.errors import ConfigError, NotImplementedConfigError

__all__ = [
    "DEFAULT_PINNED_BYTES",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "check_budget",
    "check_nvme_path",
    "check_stage",
    "parse_offload",
]

log = logging.getLogger(__name__)

DEFAULT_PINNED_BYTES = 1 << 30
"""Default of ``zero_optimization.offload_pinned_bytes``: 1 GiB of pinned swap buffers per rank."""

DEVICES = ("none", "cpu", "nvme")


@dataclass(frozen=True, kw_only=True, slots=True)
class OffloadOptimizerConfig(Section):
    """``zero_optimization.offload_optimizer``: where the fp32 master weights and Adam state live."""

    device: str = "none"
    """``"none"``, ``"cpu"`` (host memory) or ``"nvme"`` (files under ``nvme_path``, through dsio)."""
    nvme_path: str | None = None
    """Directory of the swap files (``device: "nvme"``); must exist and be writable."""
    pin_memory: bool = False
    """``device: "cpu"``: keep the offloaded state in page-locked memory (counts against the budget).
    At stage 3 with parameters not offloaded (``device`` "cpu" or "nvme"), also the fp32 master and
    gradient partitions that live in host memory (`dstrain.offload.param.host_master`), where CUDA is."""
    buffer_count: int = 4
    """Hint: swap buffers for the sub-groups in flight. The pinned budget decides the real count."""
    pipeline_read: bool = False
    """Accepted for compatibility: dstrain always reads ahead (in step order) and needs no switch."""
    pipeline_write: bool = False
    """Accepted for compatibility: dstrain always writes behind, draining during the next forward."""
    fast_init: bool = False
    """Accepted for compatibility: dstrain writes the initial state with dsio, already fast."""
    ratio: float = 1.0
    """Fraction of the optimizer step done on CPU (DeepSpeed's partial offload); only 1.0 is implemented."""
    step_in_backward: bool = True
    """dstrain extension: at stage 3, step each sub-group during the accumulation boundary's
    backward as soon as its gradient is final, its state read ahead in the order backward finishes
    the gradients (`dstrain.offload.optimizer.early_step`); bitwise the same result. Used only where legal:
    no gradient clipping, no fp16 (a master or gradients on NVMe are read during backward too);
    ``false`` steps everything in ``engine.step()``."""
    step_thread: bool = True
    """dstrain extension: with ``step_in_backward``, run those sub-group steps on one thread of their
    own (`dstrain.offload.optimizer.step_thread`), so the host Adam overlaps backward instead of
    delaying the kernels the backward thread launches; bitwise the same result. Also with parameters
    and optimizer state both on NVMe (the master in the parameter file, the gradients there too when
    ``offload_pinned_bytes`` is below their shards): the reads stay on the backward thread, the step
    and its write-backs go to the thread. ``false`` steps them on the backward thread."""

    _NO_EFFECT: ClassVar[dict[str, str]] = {
        "pipeline_read": "dstrain always reads the state ahead, in step order",
        "pipeline_write": "dstrain always writes the state behind, drained during the next forward",
        "fast_init": "dstrain writes the initial state with dsio, already at disk speed",
    }
    _UNBUILT: ClassVar[dict[str, Unbuilt]] = {
        "super_offload": Unbuilt(why="SuperOffload (GH200 superchips)", default=False),
        "cpuadam_cores_perc": Unbuilt(
            why="DeepSpeed's CPU-Adam thread share; dstrain's step uses torch's intra-op threads",
            any_value=True,
        ),
    }

    def __post_init__(self) -> None:
        p = "zero_optimization.offload_optimizer"
        _check_common(p, self.device, self.nvme_path, self.pin_memory, self.buffer_count)
        for name in ("pipeline_read", "pipeline_write", "fast_init", "step_in_backward", "step_thread"):
            check_bool(p, name, getattr(self, name))
        check_float(p, "ratio", self.ratio, min_value=0.0, max_value=1.0)
        if self.ratio != 1.0:
            raise NotImplementedConfigError(
                f"{p}.ratio", f"partial offload ({self.ratio}) is not implemented; use 1.0"
            )

    @property
    def enabled(self) -> bool:
        return self.device != "none"


@dataclass(frozen=True, kw_only=True, slots=True)
class OffloadParamConfig(Section):
    """``zero_optimization.offload_param`` (stage 3): where parameter shards live between uses."""

    device: str = "none"
    """``"none"``, ``"cpu"`` or ``"nvme"``."""
    nvme_path: str | None = None
    """Directory of the swap files (``device: "nvme"``); must exist and be writable."""
    pin_memory: bool = False
    """``device: "cpu"``: keep shards in page-locked memory (counts against the budget)."""
    buffer_count: int = 5
    """Hint: shard buffers in the swap pool. The pinned budget decides the real count."""
    buffer_size: int = 100_000_000
    """Hint: elements per shard buffer; grown to the largest unit's shard when too small (logged).
    When the budget then holds fewer than ``buffer_count`` buffers, they are cut to a typical unit's
    shard instead and larger shards are read in pieces (more of them read ahead; logged)."""
    max_in_cpu: int = 1_000_000_000
    """Accepted for compatibility. DeepSpeed keeps models under this many elements in CPU memory
    even when ``device`` is ``"nvme"``; dstrain always puts them on NVMe, as asked."""

    _NO_EFFECT: ClassVar[dict[str, str]] = {
        "max_in_cpu": "dstrain puts parameters where device says (on NVMe when asked), whatever their size",
    }

    def __post_init__(self) -> None:
        p = "zero_optimization.offload_param"
        _check_common(p, self.device, self.nvme_path, self.pin_memory, self.buffer_count)
        check_int(p, "buffer_size", self.buffer_size, min_value=1)
        check_int(p, "max_in_cpu", self.max_in_cpu, min_value=0)

    @property
    def enabled(self) -> bool:
        return self.device != "none"


def _check_common(prefix: str, device: object, nvme_path: object, pin: object, buffer_count: object) -> None:
    check_choice(prefix, "device", device, DEVICES)
    if nvme_path is not None and not isinstance(nvme_path, str | os.PathLike):
        raise ConfigError(f"{prefix}.nvme_path", f"expected a path string, got {nvme_path!r}")
    if device == "nvme" and not nvme_path:
        raise ConfigError(f"{prefix}.nvme_path", 'is required when device is "nvme"')
    check_bool(prefix, "pin_memory", pin)
    check_int(prefix, "buffer_count", buffer_count, min_value=1)


def parse_offload(value: Mapping[str, Any] | None, kind: str) -> OffloadOptimizerConfig | OffloadParamConfig:
    """Build the ``offload_optimizer`` (``kind="optimizer"``) or ``offload_param`` section.

    ``None`` (JSON null) and a missing section both mean ``device: "none"``.
    """
    if kind not in ("optimizer", "param"):
        raise ValueError(f"kind must be 'optimizer' or 'param', got {kind!r}")
    cls = OffloadOptimizerConfig if kind == "optimizer" else OffloadParamConfig
    prefix = f"zero_optimization.offload_{kind}"
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise ConfigError(prefix, f"expected an object or null, got {value!r}")
    data = dict(value)
    if data.get("device") is None:
        data["device"] = "none"
    if isinstance(data.get("nvme_path"), os.PathLike):
        data["nvme_path"] = os.fspath(data["nvme_path"])
    built: OffloadOptimizerConfig | OffloadParamConfig = build(cls, data, prefix)  # type: ignore[assignment]
    return built


def check_stage(stage: int, optimizer: OffloadOptimizerConfig, param: OffloadParamConfig) -> None:
    """Refuse combinations dstrain does not run (never downgrade them silently)."""
    if optimizer.enabled and stage == 0:
        raise NotImplementedConfigError(
            "zero_optimization.offload_optimizer.device",
            f"{optimizer.device!r} needs ZeRO stage 1, 2 or 3 (stage is 0)",
        )
    if param.enabled and stage != 3:
        raise ConfigError(
            "zero_optimization.offload_param.device",
            f"parameter offload to {param.device!r} needs ZeRO stage 3 (stage is {stage})",
        )


def check_nvme_path(field: str, path: str) -> bool:
    """Check at initialize that ``path`` is a writable directory (created, 0700, when missing); return whether it
    supports O_DIRECT (where it does not, dsio falls back to buffered I/O: logged once here, with
    what that costs). Raises `ConfigError` naming ``field`` otherwise."""
    if not os.path.exists(path):  # DeepSpeed creates it too; dstrain makes it private to the user
        try:
            os.makedirs(path, mode=0o700)
        except FileExistsError:
            pass  # another rank made it first
        except OSError as e:
            raise ConfigError(field, f"{path!r} does not exist and cannot be created: {e.strerror}") from e
        log.info("%s: created %r (mode 0700)", field, path)
    if not os.path.isdir(path):
        raise ConfigError(field, f"{path!r} is not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".dstrain-probe-", dir=path)
    except OSError as e:
        raise ConfigError(field, f"{path!r} is not writable: {e.strerror}") from e
    os.close(fd)
    try:
        try:
            fd = os.open(probe, os.O_RDWR | os.O_DIRECT)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise ConfigError(field, f"{path!r}: cannot open a file there: {e.strerror}") from e
            log.warning(
                "%s: the filesystem under %r does not support O_DIRECT; swap I/O goes through the page "
                "cache (an extra copy per byte, and cached pages outside the pinned budget)",
                field,
                path,
            )
            return False
        os.close(fd)
        return True
    finally:
        os.unlink(probe)


def check_budget(value: object) -> int:
    """Validate ``zero_optimization.offload_pinned_bytes``."""
    check_int("zero_optimization", "offload_pinned_bytes", value, min_value=1 << 20)
    return int(value)  # type: ignore[call-overload]
