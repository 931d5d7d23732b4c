"""Record every config key DeepSpeed reads, with its default, into tests/dstrain/fixtures/deepspeed_keys.json.

Run with a DeepSpeed installation (the reference venv)::

    $DSIO_DEEPSPEED_VENV/bin/python scripts/record_deepspeed_keys.py

Top-level keys come from running ``DeepSpeedConfig`` over a dict that records each key looked up;
nested keys from DeepSpeed's pydantic section models (``model_fields``, aliases included) and from
the ``*_DEFAULT`` constants of the sections parsed by hand. dstrain's config reference
(`dstrain.config_schema`) must give a status for every key in the file (tests/dstrain/test_config_schema.py).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("RANK", "0")
os.environ.setdefault("WORLD_SIZE", "1")
os.environ.setdefault("LOCAL_RANK", "0")

import deepspeed  # noqa: E402
from deepspeed.runtime.config import DeepSpeedConfig  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "tests" / "dstrain" / "fixtures" / "deepspeed_keys.json"


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except TypeError:
        return repr(value)


def top_level() -> dict[str, Any]:
    seen: dict[str, Any] = {}

    class Recorder(dict):  # type: ignore[type-arg]
        def get(self, key: Any, default: Any = None) -> Any:
            seen.setdefault(key, _jsonable(default))
            return dict.get(self, key, default)

        def __contains__(self, key: object) -> bool:
            seen.setdefault(key, None)
            return dict.__contains__(self, key)

    DeepSpeedConfig(Recorder({"train_batch_size": 1}))
    return {k: v for k, v in seen.items() if isinstance(k, str)}


def model_keys(prefix: str, model: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, f in model.model_fields.items():
        default = None if f.is_required() else f.get_default(call_default_factory=True)
        for key in {name, f.alias or name}:
            if hasattr(type(default), "model_fields"):
                out.update(model_keys(f"{prefix}.{key}", type(default)))
            else:
                out[f"{prefix}.{key}"] = _jsonable(default)
    return out


def constants(prefix: str, module: Any, stem: str) -> dict[str, Any]:
    out = {}
    for name in dir(module):
        if name.startswith(stem) and not name.endswith("_DEFAULT") and f"{name}_DEFAULT" in dir(module):
            key = getattr(module, name)
            if isinstance(key, str):
                out[f"{prefix}.{key}"] = _jsonable(getattr(module, f"{name}_DEFAULT"))
    return out


def main() -> None:
    from deepspeed.comm.config import CommsLoggerConfig
    from deepspeed.monitor.config import CometConfig, CSVConfig, TensorBoardConfig, WandbConfig
    from deepspeed.profiling import constants as flops
    from deepspeed.runtime.activation_checkpointing import config as act
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.swap_tensor import constants as aio
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadOptimizerConfig,
        DeepSpeedZeroOffloadParamConfig,
    )

    keys = top_level()
    for extra in (
        "optimizer",
        "scheduler",
        "aio",
        "flops_profiler",
        "activation_checkpointing",
        "autotuning",
    ):
        keys.setdefault(extra, None)
    keys.update(model_keys("zero_optimization", DeepSpeedZeroConfig))
    keys.update(model_keys("zero_optimization.offload_optimizer", DeepSpeedZeroOffloadOptimizerConfig))
    keys.update(model_keys("zero_optimization.offload_param", DeepSpeedZeroOffloadParamConfig))
    keys.update(model_keys("fp16", DeepSpeedFP16Config))
    keys.update(model_keys("bf16", DeepSpeedBF16Config))
    for section, model in (
        ("tensorboard", TensorBoardConfig),
        ("wandb", WandbConfig),
        ("csv_monitor", CSVConfig),
        ("comet", CometConfig),
        ("comms_logger", CommsLoggerConfig),
    ):
        keys.update(model_keys(section, model))
    keys.update(constants("flops_profiler", flops, "FLOPS_PROFILER_"))
    keys.update(constants("activation_checkpointing", act, "ACT_CHKPT_"))
    keys.update(constants("aio", aio, "AIO_"))
    for key, default in {
        "stages": "auto",
        "partition": "best",
        "seed_layers": False,
        "activation_checkpoint_interval": 0,
        "pipe_partitioned": True,
        "grad_partitioned": True,
        "use_reentrant": True,
    }.items():  # runtime/config.py get_pipeline_config (use_reentrant: pipe/engine.py)
        keys[f"pipeline.{key}"] = default
    for key in ("tag_validation", "load_universal", "use_node_local_storage", "parallel_write"):
        keys.setdefault(f"checkpoint.{key}", None)
    keys = {k: keys[k] for k in sorted(keys) if "." not in k or k.split(".")[0] in keys}
    OUT.write_text(
        json.dumps({"deepspeed": deepspeed.__version__, "keys": keys}, indent=1, sort_keys=True) + "\n"
    )
    print(f"{len(keys)} keys of DeepSpeed {deepspeed.__version__} -> {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
