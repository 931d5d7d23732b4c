"""Record DeepSpeed's TrainSchedule instruction streams as JSON (the fixture test_pipe_schedule.py compares to).

Run with DeepSpeed's venv (it imports deepspeed; nothing else):

    DS_ACCELERATOR=cpu /work/ds-venv/bin/python tests/dstrain/pipe_record_ds_schedule.py \
        > tests/dstrain/pipe_ds_train_schedule.json

The fixture was produced this way from deepspeed 0.19.8. Keys are "stages,micro_batches,stage"; each value is
the list of steps, each step a list of [instruction class name, buffer_id or null].
"""

import json
import sys

STAGES = (1, 2, 3, 4)
MICRO_BATCHES = (1, 2, 3, 4, 5, 8)


def main() -> None:
    import deepspeed
    from deepspeed.runtime.pipe.schedule import TrainSchedule

    out = {"deepspeed": deepspeed.__version__, "streams": {}}
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
