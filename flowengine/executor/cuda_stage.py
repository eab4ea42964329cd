"""What a pipeline stage needs on CUDA beyond the shared stage path.

The stage logic itself (receive the previous stage's [2, T, hidden_size] hidden states
and residual, run this stage's layers, send them on; only the last stage applies the
final norm and the LM head and samples) is `ModelRunner.run_model`, which
`CudaModelRunner` shares; the tensors travel through `PipelineStage.send_next` /
`recv_prev` (torch.distributed over NCCL between GPUs, flowengine/distributed/
pp_group.py). This module holds the CUDA-only parts:

* `StageProfileModel`: the memory profile's forward for a stage (memory_profile.py runs
  `model(input_ids, ...)` then `model.compute_logits`): a stage other than the first
  starts from a received [2, T, hidden_size] tensor, allocated inside the profile so
  its bytes count; a stage other than the last has no LM head, computes no logits and
  runs no sampler.
* `stage_runs_eagerly`: the decision that a stage of a pipeline of more than one stage
  runs eagerly. A non-last stage's captured graph would have to end before its send
  and a non-first one's begin after its recv (both outside the graph, into and out of
  static buffers): possible, but not done yet. Micro-batch overlap is unaffected: each
  stage is its own process on its own GPU, and NCCL's send/recv only order the stages'
  streams, so stage 0 computes micro-batch N + 1 while stage 1 computes N.
* `local_gpu_index`: the GPU each executor rank drives (actors/procs.py sets it before
  the NCCL group is joined).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from flowengine.distributed.pp_group import PipelineStage
from flowengine.model.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)


class StageProfileModel(nn.Module):
    """The model of one pipeline stage as `profile_memory` calls it.

    Forward: `input_ids`, `positions`, the stage's KV caches (one per layer of the
    stage), metadata -> what the stage produces ([2, T, hidden_size] before the last
    stage, final-norm [T, hidden_size] on it). A stage other than the first receives
    zeros of the previous stage's shape instead of embedding. `compute_logits` is the
    model's on the last stage and None before it (the profile then skips the sampler,
    as on tensor-parallel ranks other than 0).
    """

    def __init__(self, model: nn.Module, stage: PipelineStage, hidden_size: int,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.model = model
        self.stage = stage
        self.hidden_size = hidden_size
        self.dtype = dtype

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        intermediate = None
        if not self.stage.is_first:
            intermediate = torch.zeros((2, input_ids.shape[0], self.hidden_size),
                                       dtype=self.dtype, device=input_ids.device)
        return self.model.forward_stage(input_ids, positions, kv_caches, meta, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        if not self.stage.is_last:
            return None
        return self.model.compute_logits(hidden)


def stage_runs_eagerly(stage: PipelineStage) -> bool:
    """True (and logged once per runner) when `stage` belongs to a pipeline of more
    than one stage: its steps run eagerly, without CUDA graphs (module docstring)."""
    if stage.size == 1:
        return False
    logger.info("pipeline stage %d of %d (layers %d..%d) runs eagerly: no CUDA graphs "
                "under pipeline parallelism yet", stage.rank, stage.size,
                stage.start_layer, stage.end_layer - 1)
    return True


def local_gpu_index(dp_rank: int, tensor_parallel_size: int, pipeline_parallel_size: int,
                    rank: int, num_visible: int) -> int:
    """The CUDA device index executor `rank` of data-parallel replica `dp_rank` drives.

    Every rank of every replica gets its own GPU: dp_rank * tp * pp + rank among the
    visible ones. A process that sees exactly one GPU (a Ray actor placed with
    num_gpus=1: Ray sets CUDA_VISIBLE_DEVICES to its GPU) drives that one, index 0.

    Raises ValueError when the index is not visible (more ranks than GPUs).
    """
    index = dp_rank * tensor_parallel_size * pipeline_parallel_size + rank
    if index < num_visible:
        return index
    if num_visible == 1:
        return 0
    raise ValueError(
        f"executor rank {rank} of data-parallel replica {dp_rank} needs GPU {index} "
        f"(tensor_parallel_size {tensor_parallel_size} x pipeline_parallel_size "
        f"{pipeline_parallel_size} GPUs per replica), but torch sees {num_visible} GPUs")
