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
all-reduce. With expert parallelism (`--enable-expert-parallel`,
flowengine/distributed/expert_parallel.py) each rank holds E / N whole experts instead,
computes only the pairs routed to them, and the same all-reduce sums the ranks' parts.
On CUDA the router's softmax top-k (`route_topk`; up to 16 tokens with the router
GEMV in the same launch, `route_topk_gemv`) and the experts run in the fused Triton
kernels (flowengine/kernels/fused_moe.py); elsewhere `select_experts` and
`fused_moe_torch`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flowengine.distributed.expert_parallel import ExpertPlacement, place_experts
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
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    expert_map: torch.Tensor | None = None) -> torch.Tensor:
    """The reference MoE computation: sum_k topk_weights[t, k] * expert_{ids[t, k]}(x[t]).

    x: [T, hidden]; w13: [E, 2 * I, hidden] (gate rows then up rows); w2: [E, hidden, I];
    topk_weights: [T, k] float32; topk_ids: [T, k] int64 in [0, E). expert_map (expert
    parallelism): [E] int32, global id -> local index into w13 / w2, -1 for another
    rank's expert (those pairs add nothing). Returns [T, hidden] in x's dtype. Tokens are grouped by expert (one matmul pair per expert that has
    tokens) and the experts' contributions are added in ascending expert order, as
    transformers' MoE blocks do. Reads the per-expert counts on the host (a device sync).
    """
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros_like(x)
    if num_tokens == 0:
        return out
    flat_ids = topk_ids.reshape(-1)
    if expert_map is not None:
        # Another rank's pairs go to a bucket past the local experts, never computed.
        flat_ids = expert_map.long()[flat_ids]
        flat_ids = torch.where(flat_ids >= 0, flat_ids, w13.shape[0])
    order = torch.argsort(flat_ids, stable=True)  # (token, slot) pairs grouped by expert
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()[:w13.shape[0]]
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
        tp: the tensor-parallel group; each rank holds intermediate_size / N of every
            expert, or with `expert_parallel` num_experts / N whole experts (expert e
            on rank e // (num_experts / N)).
        expert_parallel: place whole experts on the ranks (`--enable-expert-parallel`).
        checkpoint_names: the per-expert tensor names (gate, up, down) under
            `<prefix>.<expert>.`: ("gate_proj", "up_proj", "down_proj") for Qwen/OLMoE,
            ("w1", "w3", "w2") for Mixtral.

    Raises:
        ValueError: intermediate_size (num_experts with `expert_parallel`) not divisible
            by the tensor-parallel size.
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, tp: TensorParallelGroup,
                 checkpoint_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                 expert_parallel: bool = False) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.renormalize = renormalize
        self.tp = tp
        self.checkpoint_names = checkpoint_names
        self.placement: ExpertPlacement | None = None
        if expert_parallel and tp.world_size > 1:
            self.placement = place_experts(num_experts, tp)
            self.local_start, self.local_size = 0, intermediate_size
            local_experts = self.placement.count
        else:
            self.local_start, self.local_size = tp.shard(intermediate_size,
                                                         "moe_intermediate_size")
            local_experts = num_experts
        self.w13_weight = nn.Parameter(torch.empty(local_experts, 2 * self.local_size,
                                                   hidden_size))
        self.w2_weight = nn.Parameter(torch.empty(local_experts, hidden_size, self.local_size))
        # [num_experts] int32 global -> local expert (-1: another rank's); filled by
        # init_buffers once the module has its device (it is built on "meta").
        self.register_buffer("expert_map", torch.empty(
            num_experts if self.placement is not None else 0, dtype=torch.int32),
            persistent=False)
        # [ROUTER_GEMV_MAX_TOKENS] int32 zeros: the fused router launch's per-token
        # counter (`route_topk_gemv`), zeroed by init_buffers, left zero by each launch.
        self.register_buffer("router_counter", torch.empty(16, dtype=torch.int32),
                             persistent=False)

    def init_buffers(self) -> None:
        """Fill `expert_map` and zero `router_counter` on the module's device (the loader
        calls this after `to_empty`)."""
        if self.placement is not None:
            self.expert_map.copy_(self.placement.expert_map(self.expert_map.device))
        self.router_counter.zero_()

    def route_and_forward(self, x: torch.Tensor, router_weight: torch.Tensor
                          ) -> torch.Tensor:
        """forward(x, x @ router_weight.T), with the router GEMV fused into the routing
        launch on CUDA at decode sizes (T <= ROUTER_GEMV_MAX_TOKENS)."""
        from flowengine.kernels.fused_moe import ROUTER_GEMV_MAX_TOKENS

        if (not x.is_cuda or x.shape[0] > ROUTER_GEMV_MAX_TOKENS
                or router_weight.dtype != x.dtype or not x.is_contiguous()):
            return self(x, F.linear(x, router_weight))
        from flowengine.kernels.fused_moe import fused_moe, route_topk_gemv

        expert_map = self.expert_map if self.placement is not None else None
        topk_weights, topk_ids = route_topk_gemv(x, router_weight, self.top_k,
                                                 self.renormalize, self.router_counter)
        out = fused_moe(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids,
                        expert_map)
        return self.tp.all_reduce(out)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] and router_logits [T, num_experts] -> [T, hidden], x's dtype,
        summed over the tensor-parallel ranks."""
        expert_map = self.expert_map if self.placement is not None else None
        if x.is_cuda:
            # Routing in one launch; then the fused kernel: two GEMV launches at decode
            # sizes (T * k <= decode_pair_limit), else the aligned grouped GEMMs for
            # gate/up and down. No host sync (CUDA-graph safe).
            from flowengine.kernels.fused_moe import fused_moe, route_topk

            topk_weights, topk_ids = route_topk(router_logits, self.top_k, self.renormalize)
            out = fused_moe(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids,
                            expert_map)
        else:
            topk_weights, topk_ids = select_experts(router_logits, self.top_k,
                                                    self.renormalize)
            out = fused_moe_torch(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids,
                                  expert_map)
        return self.tp.all_reduce(out)

    def weight_shards(self, prefix: str) -> list[WeightShard]:
        """The checkpoint tensors `<prefix>.<e>.<gate|up|down>.weight` for every expert e,
        each sliced to this rank's part of the expert's width and written into expert
        e's rows of the stacked parameters `<prefix>.w13_weight` / `<prefix>.w2_weight`.
        With expert parallelism: only this rank's experts, whole, into their local rows."""
        gate, up, down = self.checkpoint_names
        full_in = (self.intermediate_size, self.hidden_size)
        start, length = self.local_start, self.local_size
        shards: list[WeightShard] = []
        for e in range(self.num_experts):
            if self.placement is not None and not self.placement.is_local(e):
                continue
            base = f"{prefix}.{e}"
            local = e - self.placement.start if self.placement is not None else e
            shards += [
                WeightShard(f"{base}.{gate}.weight", f"{prefix}.w13_weight", full_in, 0,
                            start, length, 0, expert=local),
                WeightShard(f"{base}.{up}.weight", f"{prefix}.w13_weight", full_in, 0,
                            start, length, length, expert=local),
                WeightShard(f"{base}.{down}.weight", f"{prefix}.w2_weight",
                            (self.hidden_size, self.intermediate_size), 1, start, length,
                            expert=local),
            ]
        return shards

    def other_ranks_weight_names(self, prefix: str) -> set[str]:
        """Checkpoint tensors of the experts other expert-parallel ranks hold (skipped
        when loading here); empty without expert parallelism."""
        if self.placement is None:
            return set()
        return {f"{prefix}.{e}.{name}.weight" for e in range(self.num_experts)
                if not self.placement.is_local(e) for name in self.checkpoint_names}


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
        if self.gate.bias is None:
            out = self.experts.route_and_forward(x, self.gate.weight)
        else:
            out = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            assert self.shared_expert_gate is not None
            shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
            out = out + shared
        return out
