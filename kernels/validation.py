"""Argument checks shared by the kernel wrappers.

Triton kernels read raw pointers, so a wrong shape, dtype or device is not an error
there but silent garbage; every wrapper checks its inputs here first and raises an
error that says what to change.
"""

from __future__ import annotations

import torch


def check_tensor(
    name: str,
    tensor: torch.Tensor,
    *,
    ndim: int,
    dtypes: tuple[torch.dtype, ...] | None = None,
    device: torch.device | None = None,
) -> None:
    """Check rank, dtype, device and a unit stride on the last dimension.

    Raises:
        ValueError: `tensor` has the wrong rank or dtype, lives on another device than
            `device`, or its last dimension is strided (kernels load rows as vectors).
    """
    if tensor.dim() != ndim:
        raise ValueError(
            f"{name} must have {ndim} dimensions, got shape {tuple(tensor.shape)}"
        )
    if dtypes is not None and tensor.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise ValueError(f"{name} must have dtype in ({allowed}), got {tensor.dtype}")
    if device is not None and tensor.device != device:
        raise ValueError(
            f"{name} is on {tensor.device} but the other inputs are on {device}; "
            "move all inputs to one device"
        )
    if tensor.numel() > 0 and tensor.stride(-1) != 1:
        raise ValueError(
            f"{name} must be contiguous in its last dimension (stride {tensor.stride(-1)}); "
            "pass tensor.contiguous()"
        )


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
