"""Tensor parallelism across the executor processes of one host (DESIGN.md §6, §9)."""

from flowengine.distributed.tp_group import (
    SINGLE_RANK,
    TensorParallelGroup,
    check_tensor_parallel,
    init_tensor_parallel,
)

__all__ = ["SINGLE_RANK", "TensorParallelGroup", "check_tensor_parallel", "init_tensor_parallel"]
