"""The tensor-parallel group of one engine: its rank, its size and its collectives.

Megatron-LM's layout (Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion
Parameter Language Models Using Model Parallelism"): every rank holds 1/N of each
layer's heads and MLP columns; the attention output and MLP down projections end in
an all-reduce; the vocabulary is split by rows. Collectives go through
`torch.distributed` (NCCL between GPUs, gloo between CPU processes). Every rank runs
the same plans in the same order, so every rank issues the same collectives in the
same order; a rank that dies leaves the others blocked in a collective, and the
supervisor restarts the whole group (actors/supervisor.py).

A group of size 1 (`SINGLE_RANK`) makes every collective a no-op, so the model code
has one path for both cases.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from flowengine.distributed.pp_group import (
    PP_LAYER_PARTITION_ENV,
    SINGLE_STAGE,
    PipelineStage,
    partition_layers,
)

# A collective that waits longer than this means a peer is gone (the supervisor kills
# and restarts the group long before): fail rather than hang forever.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)


@dataclass(frozen=True)
class TensorParallelGroup:
    """One rank's view of the tensor-parallel group.

    Attributes:
        rank: this process's rank, 0 <= rank < world_size; rank 0 samples.
        world_size: the tensor-parallel size N.
        group: the `torch.distributed` process group of this stage's ranks under
            pipeline parallelism (None: the default group, every rank).
        first_rank: the global rank of this group's rank 0 (collectives name their
            root by global rank).
    """

    rank: int = 0
    world_size: int = 1
    group: Any = field(default=None, compare=False, repr=False)
    first_rank: int = 0

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def shard(self, size: int, what: str) -> tuple[int, int]:
        """(start, length) of this rank's equal share of `size` rows.

        Raises ValueError naming `what` when size does not divide by world_size.
        """
        if size % self.world_size:
            raise ValueError(
                f"{what} ({size}) is not divisible by tensor_parallel_size {self.world_size}"
            )
        length = size // self.world_size
        return self.rank * length, length

    def padded_shard(self, size: int) -> tuple[int, int, int]:
        """(start, rows held, rows filled) for a split of `size` rows padded up to a
        multiple of world_size (the vocabulary): every rank holds ceil(size / N) rows,
        the last ones may hold fewer real rows (the rest is padding)."""
        per_rank = -(-size // self.world_size)
        start = min(self.rank * per_rank, size)
        return start, per_rank, min(per_rank, size - start)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place; returns it (any shape, any float dtype)."""
        if self.world_size > 1:
            torch.distributed.all_reduce(tensor, group=self.group)
        return tensor

    def all_reduce_min(self, value: int, device: torch.device) -> int:
        """The smallest `value` over the ranks (e.g. KV blocks that fit every device)."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's [R, C] `tensor` (equal shapes) into [R, N * C] on
        rank 0, in rank order; other ranks get None."""
        if self.world_size == 1:
            return tensor
        tensor = tensor.contiguous()
        parts = ([torch.empty_like(tensor) for _ in range(self.world_size)]
                 if self.is_first else None)
        torch.distributed.gather(tensor, parts, dst=self.first_rank, group=self.group)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def broadcast_from_first(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's `tensor` on every rank, in place (others pass a buffer of the same
        shape and dtype); returns it."""
        if self.world_size > 1:
            torch.distributed.broadcast(tensor, src=self.first_rank, group=self.group)
        return tensor


SINGLE_RANK = TensorParallelGroup()


def init_tensor_parallel(rank: int, world_size: int, init_method: str,
                         device: torch.device) -> TensorParallelGroup:
    """Join the group as `rank` (call once per executor process, before loading weights).

    Args:
        init_method: the rendezvous, e.g. "tcp://127.0.0.1:PORT" (the supervisor picks
            a free port for each group it starts).
        device: this rank's device; NCCL on CUDA, gloo on the CPU.

    Raises:
        ValueError: rank outside [0, world_size).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a tensor-parallel group of {world_size}")
    if world_size == 1:
        return SINGLE_RANK
    backend = "nccl" if device.type == "cuda" else "gloo"
    torch.distributed.init_process_group(backend, init_method=init_method, rank=rank,
                                         world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
    return TensorParallelGroup(rank, world_size)


def init_parallel(rank: int, tensor_parallel_size: int, pipeline_parallel_size: int,
                  init_method: str, device: torch.device, num_layers: int
                  ) -> tuple[TensorParallelGroup, PipelineStage]:
    """Join the executor group as global `rank` of tensor_parallel_size *
    pipeline_parallel_size ranks (flowengine/distributed/pp_group.py gives the order)
    and return this rank's tensor-parallel group and pipeline stage.

    Every rank creates every stage's tensor-parallel subgroup, in stage order
    (`torch.distributed.new_group` is collective over all ranks).

    Raises ValueError: rank outside the group, or layers that cannot be split
    (`partition_layers`).
    """
    tp_size, pp_size = tensor_parallel_size, pipeline_parallel_size
    if pp_size == 1:
        return init_tensor_parallel(rank, tp_size, init_method, device), SINGLE_STAGE
    world_size = tp_size * pp_size
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside an executor group of {world_size} "
                         f"({tp_size} tensor-parallel x {pp_size} pipeline ranks)")
    bounds = partition_layers(num_layers, pp_size, os.environ.get(PP_LAYER_PARTITION_ENV))
    backend = "nccl" if device.type == "cuda" else "gloo"
    torch.distributed.init_process_group(backend, init_method=init_method, rank=rank,
                                         world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
    stage_rank, tp_rank = divmod(rank, tp_size)
    tp = TensorParallelGroup(tp_rank, tp_size)
    if tp_size > 1:
        groups = [torch.distributed.new_group(list(range(s * tp_size, (s + 1) * tp_size)),
                                              timeout=COLLECTIVE_TIMEOUT)
                  for s in range(pp_size)]
        tp = TensorParallelGroup(tp_rank, tp_size, groups[stage_rank], stage_rank * tp_size)
    start, end = bounds[stage_rank]
    return tp, PipelineStage(stage_rank, pp_size, start, end, tp_rank, tp_size)


def check_tensor_parallel(num_heads: int, num_kv_heads: int, intermediate_size: int,
                          tensor_parallel_size: int) -> None:
    """Raise ValueError, with the numbers, when the model cannot be split N ways: the
    query heads, the KV heads and the MLP width must each divide by N."""
    n = tensor_parallel_size
    bad = [f"{name} = {value}" for name, value in (
        ("num_attention_heads", num_heads), ("num_key_value_heads", num_kv_heads),
        ("intermediate_size", intermediate_size)) if value % n]
    if bad:
        raise ValueError(
            f"tensor_parallel_size {n} does not divide the model's {', '.join(bad)}; pick a "
            f"size that divides the query heads ({num_heads}), the KV heads ({num_kv_heads}) "
            f"and intermediate_size ({intermediate_size})"
        )
