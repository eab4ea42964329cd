"""The pipeline-parallel stage of one executor: its layers and its neighbours.

Pipeline parallelism (GPipe, Huang et al. 2019; vLLM's `--pipeline-parallel-size`)
splits the decoder layers into contiguous stages, one executor process (or one
tensor-parallel group) per stage. The first stage embeds the step's tokens, each stage
runs its layers and hands the hidden states and the residual stream to the next
through `torch.distributed` send/recv (gloo on the CPU, NCCL on GPUs); the last stage
applies the final norm and the LM head and samples. Every stage reads the same plans
from the `steps` ring and keeps the same block tables, but only its own layers'
weights and KV cache.

Ranks: a group of tensor_parallel_size T and pipeline_parallel_size P has T * P
ranks; rank r is tensor-parallel rank r % T of stage r // T (vLLM's order), and each
tensor-parallel rank of a stage talks to the same tensor-parallel rank of the next
(every rank of a stage holds the whole hidden states after its all-reduce).

A stage of a pipeline of size 1 (`SINGLE_STAGE`) holds every layer and sends nothing.
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass, field

import torch

# vLLM's VLLM_PP_LAYER_PARTITION under our prefix: "8,8,7" gives stage i that many layers.
PP_LAYER_PARTITION_ENV = "FLOWENGINE_PP_LAYER_PARTITION"


def partition_layers(num_layers: int, pp_size: int,
                     spec: str | None = None) -> list[tuple[int, int]]:
    """[start, end) of each stage's layers.

    The even split of vLLM (`get_pp_indices`): num_layers // pp_size each, and the
    remainder one more each to the stages just before the last (the last stage also
    runs the LM head). `spec` (FLOWENGINE_PP_LAYER_PARTITION, e.g. "16,14") overrides
    it with a count per stage.

    Raises ValueError when a stage would get no layer (num_layers < pp_size) or when
    `spec` does not give pp_size positive counts summing to num_layers.
    """
    if pp_size < 1:
        raise ValueError(f"pipeline_parallel_size must be >= 1, got {pp_size}")
    if num_layers < pp_size:
        raise ValueError(
            f"pipeline_parallel_size {pp_size} exceeds the model's {num_layers} decoder "
            f"layers (num_hidden_layers); every stage needs at least one layer: use a "
            f"pipeline_parallel_size of at most {num_layers}")
    if spec:
        try:
            counts = [int(part) for part in spec.split(",")]
        except ValueError:
            raise ValueError(f"{PP_LAYER_PARTITION_ENV}={spec!r}: expected comma-separated "
                             "layer counts, one per stage") from None
        if len(counts) != pp_size or min(counts) < 1 or sum(counts) != num_layers:
            raise ValueError(
                f"{PP_LAYER_PARTITION_ENV}={spec!r}: expected {pp_size} positive layer "
                f"counts summing to num_hidden_layers {num_layers}")
    else:
        counts = [num_layers // pp_size] * pp_size
        for i in range(2, num_layers % pp_size + 2):
            counts[-i] += 1
    bounds, start = [], 0
    for count in counts:
        bounds.append((start, start + count))
        start += count
    return bounds


@dataclass(frozen=True)
class PipelineStage:
    """One rank's view of the pipeline.

    Attributes:
        rank: the stage, 0 <= rank < size; stage 0 embeds, stage size - 1 samples.
        size: the pipeline_parallel_size P.
        start_layer, end_layer: this stage's decoder layers [start, end) (all layers
            when size is 1: see `layer_range`).
        tp_rank, tp_size: this rank's place in its stage's tensor-parallel group; the
            neighbours are the same tensor-parallel rank of the stages around it.
    """

    rank: int = 0
    size: int = 1
    start_layer: int = 0
    end_layer: int = 0
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def layer_range(self, num_layers: int) -> range:
        """The decoder layers this stage runs, out of the model's num_layers."""
        if self.size == 1:
            return range(num_layers)
        return range(self.start_layer, self.end_layer)

    def _peer(self, stage: int) -> int:
        return stage * self.tp_size + self.tp_rank

    def send_next(self, tensor: torch.Tensor) -> None:
        """Send `tensor` (the [2, T, hidden_size] hidden states and residual) to the
        next stage; returns once the tensor may be reused."""
        torch.distributed.send(tensor.contiguous(), dst=self._peer(self.rank + 1))

    def recv_prev(self, shape: tuple[int, ...], dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
        """Receive the previous stage's `send_next` tensor of `shape` and `dtype` (both
        sides derive the shape from the same plan, so no shape travels)."""
        tensor = torch.empty(shape, dtype=dtype, device=device)
        torch.distributed.recv(tensor, src=self._peer(self.rank - 1))
        return tensor

    def all_reduce_min(self, value: int, device: torch.device) -> int:
        """The smallest `value` over every rank of the group (all stages and their
        tensor-parallel ranks): e.g. the KV blocks that fit every stage's memory."""
        if self.size == 1 and self.tp_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
        return int(t.item())


SINGLE_STAGE = PipelineStage()


@dataclass(frozen=True)
class LocalPipelineStage(PipelineStage):
    """A stage of a pipeline whose stages all run in this process, on one device
    (tests; the one-GPU check of the CUDA stage path, tests/gpu/test_pp_gpu.py): no
    torch.distributed. `send_next` hands a copy of the tensor to the next stage
    through `pipes[rank]`, a FIFO shared by the stages of `local_pipeline`, which
    `recv_prev` of the next stage takes from; any order of running the stages works
    as long as each stage runs the plans in step order and a plan's stages run in
    stage order. `all_reduce_min` returns the value unchanged (give every stage the
    same num_kv_blocks)."""

    pipes: dict = field(default_factory=dict, compare=False, repr=False)

    def send_next(self, tensor: torch.Tensor) -> None:
        self.pipes.setdefault(self.rank, deque()).append(tensor.clone())

    def recv_prev(self, shape: tuple[int, ...], dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
        pipe = self.pipes.get(self.rank - 1)
        if not pipe:
            raise RuntimeError(f"stage {self.rank} receives before stage {self.rank - 1} "
                               "sent: run a plan's stages in stage order")
        tensor = pipe.popleft()
        if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            raise RuntimeError(f"stage {self.rank} expected {tuple(shape)} {dtype} from "
                               f"stage {self.rank - 1}, got {tuple(tensor.shape)} "
                               f"{tensor.dtype}")
        return tensor.to(device)

    def all_reduce_min(self, value: int, device: torch.device) -> int:
        return value


def local_pipeline(num_layers: int, pp_size: int,
                   spec: str | None = None) -> list[LocalPipelineStage]:
    """The pp_size stages of one in-process pipeline (`LocalPipelineStage`), their
    layers split as `partition_layers(num_layers, pp_size, spec)`."""
    pipes: dict = {}
    return [LocalPipelineStage(i, pp_size, start, end, pipes=pipes)
            for i, (start, end) in enumerate(partition_layers(num_layers, pp_size, spec))]


def check_pipeline_parallel(num_layers: int, pipeline_parallel_size: int) -> None:
    """Raise ValueError, with the numbers, when the layers cannot be split into
    pipeline_parallel_size stages (also checks FLOWENGINE_PP_LAYER_PARTITION)."""
    if pipeline_parallel_size > 1:
        partition_layers(num_layers, pipeline_parallel_size,
                         os.environ.get(PP_LAYER_PARTITION_ENV))
