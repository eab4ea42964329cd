"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): the Qwen2 decoder (q/k/v biases) whose MLPs
are fine-grained experts plus one shared expert that every token uses, scaled by
sigmoid(x w_gate) (modeling_qwen2_moe.py). Top-k probabilities are renormalised only
with `norm_topk_prob`. Layers in `mlp_only_layers` (or off the `decoder_sparse_step`
grid) keep a dense MLP.

Checkpoint names: `mlp.gate.weight`, `mlp.experts.<e>.gate_proj|up_proj|down_proj.weight`,
`mlp.shared_expert.gate_proj|up_proj|down_proj.weight`, `mlp.shared_expert_gate.weight`.
"""

from __future__ import annotations

from torch import nn

from flowengine.model.layers.moe import FusedMoE, SparseMoeBlock
from flowengine.model.models.llama import LlamaForCausalLM, LlamaMLP


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    """Qwen2-MoE over a paged KV cache; arguments and errors as LlamaForCausalLM."""

    def make_mlp(self, layer_idx: int) -> nn.Module | None:
        c = self.config
        if not c.is_moe_layer(layer_idx):
            return None
        shared = (LlamaMLP(c, self.tp, c.shared_expert_intermediate_size)
                  if c.shared_expert_intermediate_size else None)
        experts = FusedMoE(c.num_experts, c.num_experts_per_tok, c.hidden_size,
                           c.moe_intermediate_size, c.norm_topk_prob, self.tp,
                           expert_parallel=c.enable_expert_parallel)
        return SparseMoeBlock(experts, shared)
