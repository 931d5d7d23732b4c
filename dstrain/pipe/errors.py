"""Exceptions of the pipeline engine, each documented with when it is raised.

Every failure inside a pipelined batch ends every rank of the job with one of these, never a hang: the rank
that fails tells its pipeline neighbours (an abort message in place of its next activation or gradient), they
tell theirs, and the end-of-batch status all-reduce tells the other data-parallel replicas.
"""

from __future__ import annotations

from dstrain.errors import DstrainError, ReshapeError

__all__ = [
    "DataExhaustedError",
    "LabelMismatchError",
    "P2PTimeoutError",
    "PartitionError",
    "PipelineAbortedError",
    "ProcessGroupMissingError",
    "PipelineError",
    "PipelineLayoutError",
    "ShapeMismatchError",
]


class PipelineError(DstrainError):
    """Base class of the pipeline's errors. After one is raised by ``train_batch``/``eval_batch`` the
    pipeline's channels are poisoned: every later call raises `PipelineError` at once (restart the job)."""


class PartitionError(PipelineError, ValueError):
    """Layers cannot be split as asked: fewer layers than stages, a stage left without layers, an unknown
    ``partition_method``, a ``type:`` regex that matches no layer, or ``num_stages`` that does not divide
    the world size."""


class P2PTimeoutError(PipelineError, TimeoutError):
    """A pipeline neighbour sent nothing for ``p2p_timeout`` seconds (it died or hangs outside dstrain)."""


class PipelineAbortedError(PipelineError):
    """Another rank failed during this batch (its error is named in the message); raised on every rank that
    did not fail itself. No optimizer step was taken on any rank."""


class PipelineLayoutError(PipelineError, ReshapeError):
    """A checkpoint written by another pipeline layout (stage count, this rank's stage, the split or the
    layers) is loaded: a stage's state is its layers', not resharded. The message names both layouts;
    raised before anything of the checkpoint is applied."""


class DataExhaustedError(PipelineError):
    """The data iterator ran out before ``gradient_accumulation_steps`` micro-batches were loaded."""


class ShapeMismatchError(PipelineError, ValueError):
    """A received gradient's shape or dtype differs from the activation it belongs to, or a micro-batch's
    labels disagree with its inputs in batch size."""


class LabelMismatchError(PipelineError, ValueError):
    """The last stage's labels are not the labels the first stage loaded with that micro-batch (the two
    stages' data iterators are out of step): the loss would pair activations with another batch's labels."""


class ProcessGroupMissingError(PipelineError, RuntimeError):
    """A multi-stage `PipelineModule` was built under a launcher (``WORLD_SIZE`` > 1) before the process
    group existed: it would build stage 0 on every rank. Call ``dstrain.init_distributed()`` first."""
