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


# -- IOConfig.from_deepspeed: the one parser of DeepSpeed's "aio" block ------------------------
def test_from_deepspeed_empty_block_takes_deepspeeds_defaults():
    for block in ({}, None):
        cfg = IOConfig.from_deepspeed(block)
        assert (cfg.block_size, cfg.queue_depth, cfg.intra_op_parallelism) == (1 << 20, 8, 1)
        assert cfg.single_submit is False and cfg.overlap_events is True
        assert cfg.gpu_backend == "auto"


def test_from_deepspeed_maps_every_key():
    cfg = IOConfig.from_deepspeed(
        {
            "block_size": 262144,
            "queue_depth": 32,
            "thread_count": 2,
            "single_submit": True,
            "overlap_events": False,
            "use_gds": True,
            "backend": "posix",
        },
        pool_bytes=16 << 20,
    )
    assert cfg == IOConfig(
        block_size=262144,
        queue_depth=32,
        intra_op_parallelism=2,
        single_submit=True,
        overlap_events=False,
        gpu_backend="cufile",
        backend="posix",
        pool_bytes=16 << 20,
    )
    assert IOConfig.from_deepspeed({"use_gds": False}).gpu_backend == "bounce"


def test_to_deepspeed_round_trips():
    cfg = IOConfig(
        block_size=1 << 16, queue_depth=16, intra_op_parallelism=3, overlap_events=False, backend="aio"
    )
    assert IOConfig.from_deepspeed(cfg.to_deepspeed()) == cfg
    assert set(IOConfig().to_deepspeed()) == {
        "block_size",
        "queue_depth",
        "intra_op_parallelism",
        "single_submit",
        "overlap_events",
    }


@pytest.mark.parametrize(
    "block,key",
    [
        ({"block_size": 512}, "block_size"),  # DeepSpeed accepts 512; a handle does not
        ({"block_size": 4096 * 3}, "block_size"),
        ({"queue_depth": 0}, "queue_depth"),
        ({"thread_count": 0}, "thread_count"),  # the error names the key the user wrote
        ({"intra_op_parallelism": "2"}, "intra_op_parallelism"),
        ({"single_submit": "yes"}, "single_submit"),
        ({"use_gds": 1}, "use_gds"),
        ({"overlap_events": None}, "overlap_events"),
        ({"blocksize": 4096}, "blocksize"),
        ({"thread_count": 1, "intra_op_parallelism": 1}, "intra_op_parallelism"),
    ],
)
def test_from_deepspeed_errors_name_the_key(block, key):
    with pytest.raises(ConfigError) as ei:
        IOConfig.from_deepspeed(block)
    assert ei.value.field == key


def test_from_deepspeed_rejects_non_mapping_and_bad_override():
    with pytest.raises(ConfigError):
        IOConfig.from_deepspeed([("block_size", 4096)])  # type: ignore[arg-type]
    with pytest.raises(ConfigError) as ei:
        IOConfig.from_deepspeed({}, pool_bytes=1000)
    assert ei.value.field == "pool_bytes"
    with pytest.raises(ConfigError) as ei:
        IOConfig.from_deepspeed({}, nonsense=1)
    assert ei.value.field == "nonsense"


def test_config_error_pickles_with_its_field():
    import pickle

    e = pickle.loads(pickle.dumps(ConfigError("bad", field="queue_depth")))
    assert isinstance(e, ConfigError) and e.field == "queue_depth" and str(e) == "bad"
