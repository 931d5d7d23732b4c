"""Record DeepSpeed's TrainSchedule instruction streams as JSON (the fixture test_pipe_schedule.py compares to).

Run with DeepSpeed's venv (it imports deepspeed; nothing else):

    DS_ACCELERATOR=cpu $DSIO_DEEPSPEED_VENV/bin/python tests/dstrain/pipe/pipe_record_ds_schedule.py \
        > tests/dstrain/pipe/pipe_ds_train_schedule.json

The fixture was produced this way from deepspeed 0.19.8. With ``--file-only`` the recorder executes
DeepSpeed's ``runtime/pipe/schedule.py`` by itself (``import deepspeed`` takes ~20 s on a loaded 2-core box;
the file's only import, ``call_to_str``, is used just by ``__repr__`` and gets a stand-in). Keys are "stages,micro_batches,stage"; each value is
the list of steps, each step a list of [instruction class name, buffer_id or null].
"""

import json
import sys

STAGES = (1, 2, 3, 4)
MICRO_BATCHES = (1, 2, 3, 4, 5, 8)


def _load_file_only():  # type: ignore[no-untyped-def]
    """DeepSpeed's schedule.py executed as a module of a stand-in package (no ``import deepspeed``)."""
    import importlib.metadata
    import importlib.util
    import types
    from pathlib import Path

    dist = importlib.metadata.distribution("deepspeed")
    path = Path(str(dist.locate_file("deepspeed/runtime/pipe/schedule.py")))
    for name in ("_ds", "_ds.runtime", "_ds.runtime.pipe"):
        pkg = types.ModuleType(name)
        pkg.__path__ = []
        sys.modules[name] = pkg
    utils = types.ModuleType("_ds.runtime.utils")
    utils.call_to_str = lambda name, *a, **k: name  # type: ignore[attr-defined]
    sys.modules["_ds.runtime.utils"] = utils
    spec = importlib.util.spec_from_file_location("_ds.runtime.pipe.schedule", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TrainSchedule, dist.version


def main() -> None:
    if "--file-only" in sys.argv:
        TrainSchedule, version = _load_file_only()
    else:
        import deepspeed
        from deepspeed.runtime.pipe.schedule import TrainSchedule

        version = deepspeed.__version__
    out = {"deepspeed": version, "streams": {}}
    for stages in STAGES:
        for micro in MICRO_BATCHES:
            for stage in range(stages):
                sched = TrainSchedule(micro_batches=micro, stages=stages, stage_id=stage)
                steps = [[[type(c).__name__, getattr(c, "buffer_id", None)] for c in step] for step in sched]
                out["streams"][f"{stages},{micro},{stage}"] = {
                    "num_buffers": sched.num_pipe_buffers(),
                    "steps": steps,
                }
    json.dump(out, sys.stdout, indent=None, separators=(",", ":"))
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
