"""Linear layers split across the tensor-parallel group (Megatron-LM's column/row pair).

A column-parallel layer holds a slice of the output features (heads, MLP columns) and
needs no communication; the row-parallel layer after it holds the matching slice of
input features and sums the partial products with one all-reduce. With a group of one
rank both are exactly `nn.Linear` (same parameters, same `F.linear` call), so the
single-GPU and CPU numerics are unchanged.

Parameters keep `nn.Linear`'s names and layout (`weight` [out, in], `bias` [out]) so
checkpoint names map onto them directly; `LlamaForCausalLM.load_weights` copies each
rank's slice.

On the CPU a layer's weight may instead stay quantized (`quantize_as` before the
weights are loaded, `quantize_from_float` after): `weight` is then a
`QuantizedWeight` (flowengine/model/layers/quant_linear.py) over two buffers,
`weight_qs` and `weight_scales`, and the same forward runs its kernels.
"""

from __future__ import annotations

import torch
from torch import nn

from flowengine.distributed.tp_group import TensorParallelGroup
from flowengine.model.layers.quant_linear import (
    PackedTensor,
    QuantizedWeight,
    embedding,
    empty_planes,
    linear,
    quantize_q8_0,
)


class QuantizableWeight:
    """Mixin of the layers whose [rows, in_features] `weight` can stay quantized."""

    quant_format: str | None = None

    def quantize_as(self: nn.Module, fmt: str, dtype: torch.dtype) -> None:
        """Replace the (not yet materialised) float weight by empty `fmt` planes, which
        the loader fills; call before `to_empty`. dtype: the model's dtype."""
        rows, cols = self.weight.shape
        qs, scales = empty_planes(fmt, rows, cols, self.weight.device)
        self._set_planes(PackedTensor(fmt, qs, scales), dtype)

    def quantize_from_float(self: nn.Module, fmt: str = "q8_0") -> None:
        """Quantize the loaded float weight (online int8: the q8_0 layout) and drop it."""
        if fmt != "q8_0":
            raise ValueError(f"online quantization makes q8_0 weights, not {fmt!r}")
        dtype = self.weight.dtype
        self._set_planes(quantize_q8_0(self.weight), dtype)

    def _set_planes(self: nn.Module, packed: PackedTensor, dtype: torch.dtype) -> None:
        del self.weight  # the Parameter
        self.register_buffer("weight_qs", packed.qs)
        self.register_buffer("weight_scales", packed.scales)
        self.quant_format = packed.fmt
        self._quant_dtype = dtype
        if packed.qs.device.type != "meta":
            self.init_buffers()

    def init_buffers(self: nn.Module) -> None:
        """Point `weight` at the buffers (again: `to_empty` replaced them)."""
        if self.quant_format is not None:
            self.weight = QuantizedWeight(self.quant_format, self.weight_qs,
                                          self.weight_scales, self._quant_dtype)


class ColumnParallelLinear(QuantizableWeight, nn.Module):
    """y_local = x W_local^T + b_local: this rank's `out_features / N` output features.

    Args:
        in_features: full input width.
        out_features: this rank's output width (the caller divides, since fused
            projections such as qkv split each part separately).
        bias: whether the layer has a bias (sliced like the weight).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in_features] -> [T, out_features (this rank's)], x's dtype."""
        return linear(x, self.weight, self.bias)


class RowParallelLinear(QuantizableWeight, nn.Module):
    """y = all_reduce(x_local W_local^T) + b: the full output from this rank's slice of
    the input features.

    Args:
        in_features: this rank's input width (full width / N).
        out_features: full output width.
        bias: whether the layer has a bias; held whole on every rank and added once,
            after the sum.
        tp: the tensor-parallel group.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 tp: TensorParallelGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in_features (this rank's)] -> [T, out_features], x's dtype."""
        if self.tp.world_size == 1:
            return linear(x, self.weight, self.bias)
        out = self.tp.all_reduce(linear(x, self.weight, None))
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(QuantizableWeight, nn.Module):
    """Token embedding whose rows (the vocabulary) are split across the ranks.

    Each rank holds `ceil(vocab_size / N)` rows starting at `rank * that`; the last
    rank's surplus rows are padding (zero, never looked up, their logits dropped). A
    rank embeds the ids that fall in its range, zeros the others, and an all-reduce
    assembles every row. The same matrix serves as the LM head of tied models.

    Args:
        vocab_size: the full vocabulary. hidden_size: embedding width.
        tp: the tensor-parallel group.
    """

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.vocab_start, rows, _ = tp.padded_shard(vocab_size)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] int64 in [0, vocab_size) -> [T, hidden_size], weight dtype."""
        if self.tp.world_size == 1:
            return embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


def parallel_logits(hidden: torch.Tensor, weight: torch.Tensor | QuantizedWeight,
                    vocab_size: int, tp: TensorParallelGroup) -> torch.Tensor | None:
    """LM head over a vocabulary split by rows.

    hidden [R, hidden_size]; weight: this rank's [ceil(V / N), hidden_size] rows.
    Returns the full logits [R, vocab_size] float32 on rank 0 (the ranks' slices
    gathered, padding dropped) and None on the other ranks.
    """
    logits = linear(hidden, weight, None)
    if tp.world_size == 1:
        return logits.float()
    gathered = tp.gather_last_dim(logits)
    return None if gathered is None else gathered[:, :vocab_size].float()
