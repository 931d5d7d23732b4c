"""Exceptions raised by dstrain, each documented with when it is raised."""

from __future__ import annotations

from dsio.errors import PicklesByState

__all__ = [
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointRankError",
    "ConfigError",
    "DstrainError",
    "EarlyStepError",
    "IncompleteStepError",
    "InitError",
    "InsufficientDiskError",
    "NotImplementedConfigError",
    "PartitionedSaveError",
    "PretrainedMismatchError",
    "RecomputeError",
    "ReshapeError",
    "StepThreadError",
    "TopologyError",
    "UnsupportedOptimizerError",
]


class DstrainError(PicklesByState):
    """Base class of every exception dstrain raises on purpose (it round-trips through pickle with its
    message and attributes, whatever its subclass's ``__init__`` takes)."""


class ConfigError(DstrainError, ValueError):
    """A DeepSpeed-style config is invalid.

    Raised at construction of a config dataclass (or by `DSConfig.load`) when a key is unknown, a
    value has the wrong type or range, or the batch sizes disagree with the world size. ``field`` is
    the dotted path of the offending key, e.g. ``"zero_optimization.stage"``.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class NotImplementedConfigError(ConfigError):
    """A key DeepSpeed accepts and dstrain recognises but does not implement yet.

    dstrain never ignores such a key silently: a config that relies on it fails at load time.
    """


class CheckpointNotFoundError(DstrainError, FileNotFoundError):
    """`Engine.load_checkpoint` found no checkpoint (no ``latest`` file and no tag given, or no such tag)."""


class TopologyError(DstrainError, ValueError):
    """A parallel layout does not fit the world: a degree (``pp``, ``ep``) that is not a positive int or
    does not divide the world (or data-parallel) size, or a rank outside the world. Raised by
    `dstrain.dist.Layout` and `dstrain.dist.Topology` (so by `initialize`)."""


class UnsupportedOptimizerError(DstrainError, TypeError):
    """`initialize(optimizer=...)` got a torch optimizer dstrain cannot step over its master tensors:
    one whose step needs a closure (LBFGS), one that has already stepped (its state cannot follow the
    parameters), or one whose class cannot be rebuilt from its constructor arguments."""


class InitError(DstrainError, ValueError):
    """``dstrain.zero.Init`` cannot partition a module's parameters as built (e.g. a non-floating
    parameter), or a partitioned parameter is used in a way Init does not support. ``module`` names
    the module (its class and, where known, its path in the model)."""

    def __init__(self, module: str, message: str) -> None:
        super().__init__(f"{module}: {message}")
        self.module = module


class InsufficientDiskError(DstrainError, OSError):
    """Swap files would not fit: ``needed`` bytes are to be written under ``path`` and the
    filesystem has ``free`` bytes available. Raised before the write (nothing partial is left)."""

    def __init__(self, path: str, needed: int, free: int, what: str = "swap files") -> None:
        import errno

        super().__init__(
            errno.ENOSPC,
            f"{what} need {needed} bytes under {path} but only {free} bytes are free",
        )
        self.path = path
        self.needed = needed
        self.free = free
        self.what = what


class PretrainedMismatchError(DstrainError, KeyError):
    """``load_pretrained`` (strict) found that the checkpoint does not fit the model: ``missing``
    lists the model's keys the files lack, ``unexpected`` the files' keys the model lacks,
    ``mismatched`` ``(key, file shape, model shape)`` of keys whose shapes differ. Raised before any
    value is read."""

    def __init__(
        self,
        path: str,
        missing: tuple[str, ...] = (),
        unexpected: tuple[str, ...] = (),
        mismatched: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...] = (),
    ) -> None:
        parts = []
        if missing:
            parts.append(f"missing {_some(missing)}")
        if unexpected:
            parts.append(f"unexpected {_some(unexpected)}")
        if mismatched:
            parts.append(
                "shape mismatch "
                + ", ".join(_shapes(m) for m in mismatched[:10])
                + (f" and {len(mismatched) - 10} more" if len(mismatched) > 10 else "")
            )
        super().__init__(f"{path} does not fit the model: " + "; ".join(parts))
        self.path = path
        self.missing = tuple(missing)
        self.unexpected = tuple(unexpected)
        self.mismatched = tuple(mismatched)

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


def _shapes(m: object) -> str:
    if isinstance(m, tuple) and len(m) == 3:
        return f"{m[0]!r} (file {list(m[1])}, model {list(m[2])})"
    return repr(m)


def _some(keys: tuple[str, ...]) -> str:
    shown = ", ".join(repr(k) for k in keys[:20])
    return shown + (f" and {len(keys) - 20} more" if len(keys) > 20 else "")


class CheckpointMismatchError(DstrainError, ValueError):
    """A checkpoint holds another model: parameters missing from it, parameters it has that the model
    lacks, or parameters of another shape (``missing``, ``unexpected``, ``reshaped`` list the names).
    Raised by `Engine.load_checkpoint` and ``dstrain.checkpoint.load_state_dict_from_checkpoint``
    before anything is applied."""

    def __init__(
        self,
        message: str,
        missing: tuple[str, ...] = (),
        unexpected: tuple[str, ...] = (),
        reshaped: tuple[str, ...] = (),
    ) -> None:
        super().__init__(message)
        self.missing = tuple(missing)
        self.unexpected = tuple(unexpected)
        self.reshaped = tuple(reshaped)


class ReshapeError(DstrainError, ValueError):
    """A checkpoint cannot be loaded into this engine's shape: a part whose state is per rank (1-bit /
    0-1 Adam's error feedback) at another world size or stage, or experts (MoE) laid out over another
    world size. The message names the saved shape and this engine's."""


class RecomputeError(DstrainError, RuntimeError):
    """An activation checkpoint's recompute (`dstrain.checkpointing.checkpoint`, in backward) did not
    save what its forward saved (another count, shape or dtype: the function did other work the second
    time), or ran a second time after its inputs were used (a second backward through a graph not kept
    with ``retain_graph=True``)."""


class CheckpointRankError(DstrainError):
    """A rank lacks what every rank needs: the step chosen to load (its file missing on that rank's
    storage), the same committed step as the others, or a rank file an export needs. ``step`` and
    ``rank`` say which (``rank`` -1 where no single rank is at fault)."""

    def __init__(self, message: str, step: int = -1, rank: int = -1) -> None:
        super().__init__(message)
        self.step = step
        self.rank = rank


class PartitionedSaveError(DstrainError, RuntimeError):
    """A Hugging Face model's ``save_pretrained`` was called under ZeRO-3 while its parameters were
    partitioned over the ranks; the message names what saves the whole weights instead
    (``engine.save_16bit_model``, the dstrain Trainer's ``save_model``, ``dstrain export``)."""


class IncompleteStepError(DstrainError, RuntimeError):
    """Raised by every `OffloadAdam.step` (so `engine.step()`) after a sub-group step of the optimizer
    step under way failed, or could not start (its state's read failed, an async save's gate raised)
    (``__cause__``: its error, raised when it happened): the step is counted, some sub-groups are
    stepped, that one may be half-updated and others are not, so the step can be neither finished nor
    re-run, and its state neither saved nor replaced (the optimizer's ``state_dict``,
    ``checkpoint_state`` and ``load_state_dict`` raise it too). Load a checkpoint into a new engine to
    go on."""


class StepThreadError(IncompleteStepError):
    """Raised by `OffloadAdam.step` or during the boundary backward when a sub-group step run on the
    step thread (``zero_optimization.offload_optimizer.step_thread``) failed (``__cause__``: the error
    it raised), or when that thread ended; the optimizer step under way is incomplete (some sub-groups
    are not stepped)."""


class EarlyStepError(DstrainError):
    """Raised when a sub-group stepped during backward turns out not to have been final (a unit's
    gradient was reduced again afterwards in the same pass), or when the optimizer's hyperparameters
    or state are changed or read between the boundary backward and `engine.step()` while some
    sub-groups are already stepped. Set ``zero_optimization.offload_optimizer.step_in_backward`` to
    false for such models or training loops."""
