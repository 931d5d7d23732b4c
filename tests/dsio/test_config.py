import dataclasses

import pytest

import dsio
from dsio import ConfigError, IOConfig


def test_defaults_are_valid_and_frozen():
    cfg = IOConfig()
    assert cfg.block_size == 1 << 20 and cfg.backend == "auto"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.block_size = 4096  # type: ignore[misc]


@pytest.mark.parametrize(
    "field,value",
    [
        ("block_size", 3000),
        ("block_size", 1024),
        ("block_size", 4096 * 3),
        ("block_size", "1M"),
        ("queue_depth", 0),
        ("queue_depth", -1),
        ("intra_op_parallelism", 0),
        ("backend", "spdk"),
        ("gpu_backend", "nvme"),
        ("single_submit", 1),
        ("staging_buffer_bytes", 1000),
        ("pool_bytes", 4096),  # smaller than one staging buffer
    ],
)
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ConfigError) as ei:
        IOConfig(**{field: value})
    assert field in str(ei.value)
    assert isinstance(ei.value, ValueError)


def test_keyword_only():
    with pytest.raises(TypeError):
        IOConfig(4096)  # type: ignore[misc]


def test_handle_rejects_bad_override():
    with pytest.raises(ConfigError):
        dsio.AsyncIOHandle(queue_depth=0)
