"""Mixture-of-experts MLP: a softmax top-k router and SwiGLU experts held as stacked tensors.

Shazeer et al. 2017 ("Outrageously Large Neural Networks: The Sparsely-Gated
Mixture-of-Experts Layer"), in the form Mixtral (Jiang et al. 2024), Qwen2-MoE,
Qwen3-MoE and OLMoE use: router logits = x W_router^T; probabilities = softmax in
float32; the top-k experts of each token run down(silu(gate(x)) * up(x)) and their
outputs are summed weighted by their probabilities (renormalised to sum 1 when the
model says so). Qwen2-MoE adds a shared expert that every token goes through, scaled by
sigmoid(x w_gate).

Experts are stored stacked (vLLM's `FusedMoE` layout): `w13_weight` [num_experts,
2 * intermediate, hidden] (gate rows, then up rows) and `w2_weight` [num_experts,
hidden, intermediate], filled from the checkpoint's per-expert tensors by
`FusedMoE.weight_shards`. Under tensor parallelism each rank holds a slice of every
expert's intermediate dimension (vLLM's default split) and the block ends in one
all-reduce. On CUDA the experts run in the fused Triton kernel
(flowengine/kernels/fused_moe.py); elsewhere in `fused_moe_torch`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flowengine.distributed.tp_group import TensorParallelGroup
from flowengine.model.layers.activation import silu_and_mul
from flowengine.model.weight_shards import WeightShard


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing.

    router_logits: [T, num_experts] any float dtype. Returns (topk_weights [T, top_k]
    float32, topk_ids [T, top_k] int64), experts in descending probability order as
    `torch.topk` gives them. With `renormalize` the k probabilities are divided by their
    sum (Mixtral; Qwen3-MoE's `norm_topk_prob`), else they stay softmax probabilities
    over all experts (Qwen2-MoE's default).
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


def fused_moe_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The reference MoE computation: sum_k topk_weights[t, k] * expert_{ids[t, k]}(x[t]).

    x: [T, hidden]; w13: [E, 2 * I, hidden] (gate rows then up rows); w2: [E, hidden, I];
    topk_weights: [T, k] float32; topk_ids: [T, k] int64 in [0, E). Returns [T, hidden]
    in x's dtype. Tokens are grouped by expert (one matmul pair per expert that has
    tokens) and the experts' contributions are added in ascending expert order, as
    transformers' MoE blocks do. Reads the per-expert counts on the host (a device sync).
    """
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros_like(x)
    if num_tokens == 0:
        return out
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # (token, slot) pairs grouped by expert
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    token_of = order // top_k
    weight_of = topk_weights.reshape(-1)[order]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        tokens = token_of[start:start + count]
        h = silu_and_mul(F.linear(x[tokens], w13[expert]))
        h = F.linear(h, w2[expert]) * weight_of[start:start + count, None]
        out.index_add_(0, tokens, h.to(out.dtype))
        start += count
    return out


class FusedMoE(nn.Module):
    """The experts of one MoE layer, stacked; this rank's slice of each expert's width.

    Args:
        num_experts, top_k: experts in the layer and experts per token.
        hidden_size: model width. intermediate_size: each expert's full width.
        renormalize: renormalise the top-k probabilities (see `select_experts`).
        tp: the tensor-parallel group; each rank holds intermediate_size / N.
        checkpoint_names: the per-expert tensor names (gate, up, down) under
            `<prefix>.<expert>.`: ("gate_proj", "up_proj", "down_proj") for Qwen/OLMoE,
            ("w1", "w3", "w2") for Mixtral.

    Raises:
        ValueError: intermediate_size not divisible by the tensor-parallel size.
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, tp: TensorParallelGroup,
                 checkpoint_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                 ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.renormalize = renormalize
        self.tp = tp
        self.checkpoint_names = checkpoint_names
        self.local_start, self.local_size = tp.shard(intermediate_size, "moe_intermediate_size")
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * self.local_size, hidden_size))
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, self.local_size))

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] and router_logits [T, num_experts] -> [T, hidden], x's dtype,
        summed over the tensor-parallel ranks."""
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)
        if x.is_cuda:
            # One grouped GEMM per projection, no host sync (CUDA-graph safe).
            from flowengine.kernels.fused_moe import fused_moe

            out = fused_moe(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
        else:
            out = fused_moe_torch(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
        return self.tp.all_reduce(out)

    def weight_shards(self, prefix: str) -> list[WeightShard]:
        """The checkpoint tensors `<prefix>.<e>.<gate|up|down>.weight` for every expert e,
        each sliced to this rank's part of the expert's width and written into expert
        e's rows of the stacked parameters `<prefix>.w13_weight` / `<prefix>.w2_weight`."""
        gate, up, down = self.checkpoint_names
        full_in = (self.intermediate_size, self.hidden_size)
        start, length = self.local_start, self.local_size
        shards: list[WeightShard] = []
        for e in range(self.num_experts):
            base = f"{prefix}.{e}"
            shards += [
                WeightShard(f"{base}.{gate}.weight", f"{prefix}.w13_weight", full_in, 0,
                            start, length, 0, expert=e),
                WeightShard(f"{base}.{up}.weight", f"{prefix}.w13_weight", full_in, 0,
                            start, length, length, expert=e),
                WeightShard(f"{base}.{down}.weight", f"{prefix}.w2_weight",
                            (self.hidden_size, self.intermediate_size), 1, start, length,
                            expert=e),
            ]
        return shards


class SparseMoeBlock(nn.Module):
    """Router + experts (+ optional shared expert with a sigmoid gate), one layer's MLP.

    Attribute names follow the Hugging Face checkpoints: `gate` (router, [num_experts,
    hidden], whole on every rank), `experts`, `shared_expert`, `shared_expert_gate`
    ([1, hidden]).

    Args:
        experts: the layer's FusedMoE.
        shared_expert: Qwen2-MoE's shared SwiGLU MLP (tensor-parallel itself), or None.
    """

    def __init__(self, experts: FusedMoE, shared_expert: nn.Module | None = None) -> None:
        super().__init__()
        self.gate = nn.Linear(experts.hidden_size, experts.num_experts, bias=False)
        self.experts = experts
        self.shared_expert = shared_expert
        self.shared_expert_gate = (None if shared_expert is None
                                   else nn.Linear(experts.hidden_size, 1, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden], x's dtype."""
        out = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            assert self.shared_expert_gate is not None
            shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
            out = out + shared
        return out
