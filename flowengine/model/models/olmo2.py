"""OLMo 2 (OLMo et al. 2024, "2 OLMo 2 Furious"): a Llama-shaped decoder whose norms
come after the sublayers (x + norm(attn(x)), then x + norm(mlp(x)), no input norms),
with an RMSNorm over the whole q and k projections (all heads at once) before RoPE.

Checkpoint names: `self_attn.q_norm.weight` [num_heads * head_dim],
`self_attn.k_norm.weight` [num_kv_heads * head_dim], `post_attention_layernorm`,
`post_feedforward_layernorm`; the rest as Llama.
"""

from __future__ import annotations

import torch
from torch import nn

from flowengine.distributed.tp_group import SINGLE_RANK, TensorParallelGroup
from flowengine.model.attention.backend import AttentionBackend
from flowengine.model.attention.metadata import AttentionMetadata
from flowengine.model.layers.rms_norm import RMSNorm
from flowengine.model.layers.rotary import RotaryEmbedding
from flowengine.model.model_config import ModelConfig
from flowengine.model.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP


class Olmo2DecoderLayer(nn.Module):
    """Post-norm block: h = x + norm(attn(x)); out = h + norm(mlp(h)).

    Same interface as LlamaDecoderLayer: the residual stream travels beside the
    hidden states and the next layer (or the final norm) adds them, so the layer
    returns (norm(mlp(h)), h).
    """

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend,
                 tp: TensorParallelGroup = SINGLE_RANK, mlp: nn.Module | None = None,
                 mlp_name: str = "mlp") -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, attn_backend, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, tp) if mlp is None else mlp
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None, kv_cache: torch.Tensor,
                meta: AttentionMetadata, rotary: RotaryEmbedding
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) [T, hidden_size] each -> the same for the next layer."""
        x = hidden if residual is None else hidden + residual
        h = x + self.post_attention_layernorm(self.self_attn(positions, x, kv_cache, meta,
                                                             rotary))
        return self.post_feedforward_layernorm(self.mlp(h)), h


class Olmo2ForCausalLM(LlamaForCausalLM):
    """OLMo 2 over a paged KV cache; arguments and errors as LlamaForCausalLM."""

    decoder_layer_cls = Olmo2DecoderLayer
