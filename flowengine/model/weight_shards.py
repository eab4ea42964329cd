"""Which slice of each checkpoint tensor a tensor-parallel rank loads, and where.

Checkpoint tensors keep Hugging Face's names and full shapes; the model's parameters
are fused (q/k/v in `qkv_proj`, gate/up in `gate_up_proj`) and split by rank
(Megatron-LM's column/row layout, see flowengine/model/layers/linear.py). A
`WeightShard` ties the two together, so that loading reads only this rank's slice of
each tensor: safetensors slices are read lazily (`safe_open(...).get_slice`), so no
process holds the whole model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class WeightShard:
    """One checkpoint tensor's contribution to one parameter on this rank.

    Attributes:
        hf_name: the checkpoint tensor's name.
        param: the model parameter's name.
        full_shape: the checkpoint tensor's whole shape, as config.json implies.
        dim: the checkpoint dimension this rank slices (0: rows, 1: columns).
        start, length: the slice along `dim`.
        dest_start: first parameter row the slice fills when dim == 0 (fused
            projections stack their parts by rows); with dim == 1 the slice fills the
            whole parameter.
        expert: for stacked expert parameters ([num_experts, ...], see
            flowengine/model/layers/moe.py), the expert index whose [...] sub-tensor
            this shard fills (rows and slice as above, within that expert); -1: none.
    """

    hf_name: str
    param: str
    full_shape: tuple[int, ...]
    dim: int = 0
    start: int = 0
    length: int = -1  # -1: the whole dimension
    dest_start: int = 0
    expert: int = -1

    def destination(self, param: torch.Tensor) -> torch.Tensor:
        """The view of `param` this shard writes."""
        if self.expert >= 0:
            param = param[self.expert]
        if self.dim == 0 and self.length >= 0:
            return param.narrow(0, self.dest_start, self.length)
        return param


def tensor_shape(src: Any) -> tuple[int, ...]:
    """Shape of a checkpoint tensor: a torch.Tensor or a safetensors lazy slice."""
    if isinstance(src, torch.Tensor):
        return tuple(src.shape)
    return tuple(src.get_shape())


def read_shard(src: Any, shard: WeightShard) -> torch.Tensor:
    """This rank's slice of `src` (a torch.Tensor or a safetensors lazy slice, which then
    reads only the slice from disk)."""
    if shard.length < 0:
        return src if isinstance(src, torch.Tensor) else src[:]
    if isinstance(src, torch.Tensor):
        return src.narrow(shard.dim, shard.start, shard.length)
    index = (slice(None),) * shard.dim + (slice(shard.start, shard.start + shard.length),)
    return src[index]
