"""Mixtral (Jiang et al. 2024, "Mixtral of Experts"): the Mistral decoder with every
MLP replaced by 8 SwiGLU experts, top-2 routing renormalised to sum 1.

Checkpoint names: `model.layers.<i>.block_sparse_moe.gate.weight` (router) and
`...block_sparse_moe.experts.<e>.w1|w3|w2.weight` (gate, up, down of expert e).
"""

from __future__ import annotations

from torch import nn

from flowengine.model.layers.moe import FusedMoE, SparseMoeBlock
from flowengine.model.models.llama import LlamaForCausalLM


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral over a paged KV cache; arguments and errors as LlamaForCausalLM (plus
    intermediate_size not divisible by the tensor-parallel size)."""

    mlp_name = "block_sparse_moe"

    def make_mlp(self, layer_idx: int) -> nn.Module:
        c = self.config
        return SparseMoeBlock(FusedMoE(c.num_experts, c.num_experts_per_tok, c.hidden_size,
                                       c.moe_intermediate_size, True, self.tp,
                                       checkpoint_names=("w1", "w3", "w2"),
                                       expert_parallel=c.enable_expert_parallel))
