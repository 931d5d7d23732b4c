"""Pipeline parallelism with DeepSpeed's API: `PipelineModule`, `LayerSpec`, `TiedLayerSpec`.

    from dstrain.pipe import PipelineModule, LayerSpec
    model = PipelineModule([LayerSpec(Block, dim) for _ in range(n)], num_stages=2, loss_fn=loss)
    engine, _, _, _ = dstrain.initialize(model=model, config=cfg)
    loss = engine.train_batch(data_iter)          # 1F1B over gradient_accumulation_steps micro-batches

Rooms: `module` (layers, partitioning), `schedule` (1F1B as a pure instruction list), `p2p` (messages between
neighbours), `transport` (how they travel: gloo host tensors with tags, or native NCCL CUDA tensors ordered over a
group per direction), `runner` (train_batch / eval_batch from the engine's parts), `grads` (tied gradients summed
over stages, the global-norm sets of the whole pipeline for clipping), `compose` (what `initialize` calls),
`config` (the ``"pipeline"`` section), `errors`.
"""

from dstrain.pipe.config import PipelineConfig
from dstrain.pipe.errors import (
    DataExhaustedError,
    LabelMismatchError,
    P2PTimeoutError,
    PartitionError,
    PipelineAbortedError,
    PipelineError,
    PipelineLayoutError,
    ProcessGroupMissingError,
    ShapeMismatchError,
)
from dstrain.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec
from dstrain.pipe.p2p import P2PStatistics
from dstrain.pipe.runner import PipelineRunner, PipelineStatistics
from dstrain.pipe.schedule import Instruction, Op, Schedule, eval_schedule, train_schedule

__all__ = [
    "DataExhaustedError",
    "Instruction",
    "LabelMismatchError",
    "LayerSpec",
    "Op",
    "P2PStatistics",
    "P2PTimeoutError",
    "PartitionError",
    "PipelineAbortedError",
    "ProcessGroupMissingError",
    "PipelineConfig",
    "PipelineError",
    "PipelineLayoutError",
    "PipelineModule",
    "PipelineRunner",
    "PipelineStatistics",
    "Schedule",
    "ShapeMismatchError",
    "TiedLayerSpec",
    "eval_schedule",
    "train_schedule",
]
