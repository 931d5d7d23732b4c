"""The public surface of dstrain is pinned: adding or removing a name is a deliberate change."""

from __future__ import annotations

import importlib
import pkgutil

import dstrain
import dstrain.errors

EXPECTED = {
    "AioConfig",
    "BF16Config",
    "CheckpointConfig",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointRankError",
    "CheckpointStore",
    "CommStatistics",
    "ConfigError",
    "DSConfig",
    "DsioStore",
    "DstrainError",
    "Engine",
    "EngineStatistics",
    "FP16Config",
    "LRRangeTest",
    "LossScaler",
    "LossScalerStatistics",
    "NotImplementedConfigError",
    "OneCycle",
    "OptimizerConfig",
    "ReshapeError",
    "SchedulerConfig",
    "TorchSaveStore",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "ZeroConfig",
    "ZeroStatistics",
    "init_distributed",
    "initialize",
}


def test_all_is_pinned_and_resolvable() -> None:
    assert set(dstrain.__all__) == EXPECTED
    for name in dstrain.__all__:
        assert getattr(dstrain, name) is not None


def test_errors_form_a_hierarchy() -> None:
    assert issubclass(dstrain.ConfigError, ValueError)
    assert issubclass(dstrain.NotImplementedConfigError, dstrain.ConfigError)
    assert issubclass(dstrain.ConfigError, dstrain.DstrainError)
    assert issubclass(dstrain.CheckpointNotFoundError, FileNotFoundError)
    assert issubclass(dstrain.errors.StepThreadError, dstrain.DstrainError)
    assert issubclass(dstrain.errors.EarlyStepError, dstrain.DstrainError)


def _dstrain_errors() -> dict[str, type[BaseException]]:
    """Every public exception class defined in a dstrain module, by ``module.qualname`` (a private one,
    like checkpointing's ``_StopRecompute``, is control flow that never reaches a user)."""
    found: dict[str, type[BaseException]] = {}
    for info in pkgutil.walk_packages(dstrain.__path__, "dstrain."):
        try:
            mod = importlib.import_module(info.name)
        except ModuleNotFoundError as e:  # an integration whose third-party package is not installed
            if (e.name or "").split(".")[0] == "dstrain":
                raise
            continue
        for obj in vars(mod).values():
            public = isinstance(obj, type) and not obj.__qualname__.startswith("_")
            if public and issubclass(obj, BaseException) and obj.__module__ == info.name:
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return found


def test_every_error_is_defined_where_users_import_errors_from() -> None:
    # dstrain.errors, or a room's own errors module (dstrain.pipe.errors, dstrain.moe.errors): never a
    # class buried in an implementation module (StepThreadError and EarlyStepError were, in
    # dstrain.offload.optimizer.step_thread / .early_step)
    found = _dstrain_errors()
    assert "dstrain.errors.StepThreadError" in found and "dstrain.errors.EarlyStepError" in found
    stray = sorted(name for name in found if name.rpartition(".")[0].rpartition(".")[2] != "errors")
    assert stray == []
    for name, cls in found.items():
        assert issubclass(cls, dstrain.DstrainError) and cls.__doc__, name
    public = {getattr(dstrain.errors, n) for n in dstrain.errors.__all__}
    assert {c for n, c in found.items() if n.startswith("dstrain.errors.")} == public
