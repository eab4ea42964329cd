"""Tensor and pipeline parallelism across the executor processes (DESIGN.md §6, §9)."""

from flowengine.distributed.pp_group import (
    SINGLE_STAGE,
    PipelineStage,
    check_pipeline_parallel,
    partition_layers,
)
from flowengine.distributed.tp_group import (
    SINGLE_RANK,
    TensorParallelGroup,
    check_tensor_parallel,
    init_parallel,
    init_tensor_parallel,
)

__all__ = ["SINGLE_RANK", "SINGLE_STAGE", "PipelineStage", "TensorParallelGroup",
           "check_pipeline_parallel", "check_tensor_parallel", "init_parallel",
           "init_tensor_parallel", "partition_layers"]
