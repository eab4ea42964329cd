"""Expert parallelism: whole experts placed on the tensor-parallel ranks.

With `--enable-expert-parallel` (vLLM's flag) and tensor_parallel_size N, each MoE layer's
E experts are split into N contiguous groups of E / N, expert e living on rank
e // (E / N) with its full width (vLLM's default "linear" placement), instead of every
rank holding 1/N of every expert's width. Attention, the dense MLPs, Qwen2-MoE's shared
expert and the vocabulary stay tensor-parallel as before.

Every rank sees every token (the attention output is all-reduced before the MLP), and
the router is whole on every rank, so each rank computes the same top-k choice; a rank
runs only the (token, slot) pairs routed to its own experts and the weighted outputs
are summed over the ranks by the layer's one all-reduce, the same collective the
tensor-parallel split ends in. No all-to-all is needed inside one host, and the
collectives stay identical on every rank (CUDA-graph and gloo safe).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flowengine.distributed.tp_group import TensorParallelGroup


@dataclass(frozen=True)
class ExpertPlacement:
    """This rank's contiguous share of one MoE layer's experts.

    Attributes:
        num_experts: E, experts in the layer (global ids 0 .. E - 1).
        start: the first global expert id held here.
        count: experts held here (E / N).
    """

    num_experts: int
    start: int
    count: int

    def expert_map(self, device: torch.device | str) -> torch.Tensor:
        """[E] int32: global expert id -> local index in [0, count), or -1 for experts
        held by another rank (vLLM's `expert_map`)."""
        ids = torch.arange(self.num_experts, dtype=torch.int32, device=device) - self.start
        return torch.where((ids >= 0) & (ids < self.count), ids, -1).to(torch.int32)

    def is_local(self, expert: int) -> bool:
        return self.start <= expert < self.start + self.count


def check_expert_parallel(num_experts: int, tensor_parallel_size: int) -> None:
    """Raise ValueError, with the numbers, when E experts cannot be placed whole on N ranks
    (E not divisible by N, or a dense model, num_experts == 0)."""
    n = tensor_parallel_size
    if num_experts <= 0:
        raise ValueError("enable_expert_parallel needs a mixture-of-experts model (config.json "
                         "has no experts); leave it off for a dense model")
    if num_experts % n:
        divisors = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        raise ValueError(
            f"enable_expert_parallel: num_experts ({num_experts}) is not divisible by "
            f"tensor_parallel_size {n}; pick a tensor_parallel_size among {divisors} or leave "
            "expert parallelism off (each expert's width is then split instead)")


def place_experts(num_experts: int, tp: TensorParallelGroup) -> ExpertPlacement:
    """Rank tp.rank's experts: [rank * E / N, (rank + 1) * E / N). Raises ValueError as
    `check_expert_parallel`."""
    check_expert_parallel(num_experts, tp.world_size)
    count = num_experts // tp.world_size
    return ExpertPlacement(num_experts, tp.rank * count, count)
