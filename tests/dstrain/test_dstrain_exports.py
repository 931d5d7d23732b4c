"""The public surface of dstrain is pinned: adding or removing a name is a deliberate change."""

from __future__ import annotations

import dstrain

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
