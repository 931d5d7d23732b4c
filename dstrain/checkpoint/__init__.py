"""Engine checkpoints: each part of the engine contributes its state (`state`), stored through dsio's
``Checkpointer`` or the torch.save fallback (`store`)."""

from dstrain.checkpoint.state import FORMAT, CountersPart, Part, RngPart, collect, restore
from dstrain.checkpoint.store import (
    CheckpointStore,
    DsioStore,
    PendingSave,
    TorchSaveStore,
    default_store,
    load_any,
    step_name,
)

__all__ = [
    "FORMAT",
    "CheckpointStore",
    "CountersPart",
    "DsioStore",
    "Part",
    "PendingSave",
    "RngPart",
    "TorchSaveStore",
    "collect",
    "default_store",
    "load_any",
    "restore",
    "step_name",
]
