"""bench/bigmodel.py's sizing: the parameter formula matches the built model, the disk decides."""

from __future__ import annotations

import argparse

import pytest

from bench.bigmodel import DISK_BYTES_PER_PARAM, build, expected, gpt_numel, size_model


def _args(**kw: object) -> argparse.Namespace:
    base = dict(layers=0, dim=64, heads=4, vocab=100, seq=16, params=1e6, nvme_dir="/x")
    return argparse.Namespace(**{**base, **kw})


def test_formula_counts_the_built_model() -> None:
    model = build(3, 64, 4, 100, 16)
    assert sum(p.numel() for p in model.parameters()) == gpt_numel(3, 64, 100, 16)


def test_sized_to_the_target_and_shrunk_by_the_disk() -> None:
    args = _args()
    layers, note = size_model(args, free=10**12, world=1)
    assert gpt_numel(layers, 64, 100, 16) >= 1e6 > gpt_numel(layers - 1, 64, 100, 16)
    small_disk = int(gpt_numel(layers - 2, 64, 100, 16) * DISK_BYTES_PER_PARAM / 0.9) + 1
    fewer, why = size_model(args, free=small_disk, world=1)
    assert fewer == layers - 2 and "disk forces a smaller model" in why
    with pytest.raises(SystemExit):
        size_model(_args(layers=layers), free=small_disk, world=1)


def test_bytes_per_param_formulas() -> None:
    exp = expected(10)
    assert exp["dstrain_per_param"] == 38 and exp["deepspeed_per_param"] == 38
    assert expected(10, grads_on_nvme=False)["dstrain_per_param"] == 30
