"""dsio.checkpoint: async, crash-safe, safetensors-compatible checkpoints.

    await dsio.checkpoint.save(state, "/data/model.safetensors")     # one durable safetensors file
    state = await dsio.checkpoint.load("/data/model.safetensors")    # also reads stock safetensors

    ckpt = dsio.checkpoint.Checkpointer("/data/run1", keep_last=3)
    task = await ckpt.save(step, state)   # returns once staged into pinned memory
    await task                            # durable and committed
"""

from ._api import load, save

__all__ = ["load", "save"]
