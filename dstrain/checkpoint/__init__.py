"""Engine checkpoints: each part of the engine contributes its state (`state`), stored through dsio's
``Checkpointer`` or the torch.save fallback (`store`), with the layout that lets any world size, stage
or offload load it (`layout`, `reshape`) and whole weights be exported without the job (`export`);
`load_pretrained` streams a Hugging Face style safetensors checkpoint into a model's (zero.Init)
partitions."""

from dstrain.checkpoint.export import consolidated_state_dict, export, load_state_dict_from_checkpoint
from dstrain.checkpoint.layout import Layout
from dstrain.checkpoint.pretrained import PretrainedLoad, load_pretrained
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
    "Layout",
    "Part",
    "PendingSave",
    "PretrainedLoad",
    "RngPart",
    "TorchSaveStore",
    "collect",
    "consolidated_state_dict",
    "default_store",
    "export",
    "load_any",
    "load_pretrained",
    "load_state_dict_from_checkpoint",
    "restore",
    "step_name",
]
