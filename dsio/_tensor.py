"""A tensor as raw bytes: (address, nbytes), with clear errors for what cannot be one."""

from __future__ import annotations

import torch

from .errors import TensorLayoutError

__all__ = ["as_bytes", "check_offset"]


def as_bytes(tensor: object, *, what: str = "tensor") -> tuple[int, int]:
    """Return ``(data_ptr, nbytes)`` of a contiguous dense tensor (CPU or CUDA)."""
    if not isinstance(tensor, torch.Tensor):
        raise TensorLayoutError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout is not torch.strided:
        raise TensorLayoutError(f"{what} must be a dense (strided) tensor, got layout {tensor.layout}")
    if tensor.device.type == "meta":
        raise TensorLayoutError(f"{what} is on the meta device and has no data")
    if not tensor.is_contiguous():
        raise TensorLayoutError(
            f"{what} is not contiguous (shape {tuple(tensor.shape)}, strides {tensor.stride()}); "
            "pass tensor.contiguous() so the bytes on disk have a defined order"
        )
    return tensor.data_ptr(), tensor.numel() * tensor.element_size()


def check_offset(offset: object) -> int:
    """A file offset: a non-negative int."""
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise TypeError(f"offset must be an int, got {type(offset).__name__}")
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    return offset
