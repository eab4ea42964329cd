"""OLMoE (Muennighoff et al. 2024, "OLMoE: Open Mixture-of-Experts Language Models"):
the Llama decoder with an RMSNorm over the whole q and k projections (all heads at
once, before RoPE), optional q/k/v clipping (`clip_qkv`), and 64 experts top-8 in every
layer (`norm_topk_prob` false in the released models).

Checkpoint names: `self_attn.q_norm.weight` [num_heads * head_dim],
`self_attn.k_norm.weight` [num_kv_heads * head_dim], `mlp.gate.weight`,
`mlp.experts.<e>.gate_proj|up_proj|down_proj.weight`.
"""

from __future__ import annotations

from torch import nn

from flowengine.model.layers.moe import FusedMoE, SparseMoeBlock
from flowengine.model.models.llama import LlamaForCausalLM


class OlmoeForCausalLM(LlamaForCausalLM):
    """OLMoE over a paged KV cache; arguments and errors as LlamaForCausalLM. The q/k
    norms are split with the heads under tensor parallelism (ShardedRMSNorm)."""

    def make_mlp(self, layer_idx: int) -> nn.Module:
        c = self.config
        return SparseMoeBlock(FusedMoE(c.num_experts, c.num_experts_per_tok, c.hidden_size,
                                       c.moe_intermediate_size, c.norm_topk_prob, self.tp,
                                       expert_parallel=c.enable_expert_parallel))
