"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): the Qwen3 decoder (per-head q/k RMSNorm,
no biases) with fine-grained experts in its MLPs, no shared expert; Qwen3 checkpoints
set `norm_topk_prob` (renormalised top-8 of 128). Checkpoint names as Qwen2-MoE's
experts: `mlp.gate.weight`, `mlp.experts.<e>.gate_proj|up_proj|down_proj.weight`.
"""

from __future__ import annotations

from torch import nn

from flowengine.model.layers.moe import FusedMoE, SparseMoeBlock
from flowengine.model.models.llama import LlamaForCausalLM


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Qwen3-MoE over a paged KV cache; arguments and errors as LlamaForCausalLM."""

    def make_mlp(self, layer_idx: int) -> nn.Module | None:
        c = self.config
        if not c.is_moe_layer(layer_idx):
            return None
        return SparseMoeBlock(FusedMoE(c.num_experts, c.num_experts_per_tok, c.hidden_size,
                                       c.moe_intermediate_size, c.norm_topk_prob, self.tp,
                                       expert_parallel=c.enable_expert_parallel))
