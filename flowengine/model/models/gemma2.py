"""Gemma 2 (Gemma Team 2024, "Gemma 2: Improving Open Language Models at a Practical
Size"): a Llama-shaped decoder with

- embeddings scaled by sqrt(hidden_size), tied LM head;
- four norms per layer (before and after attention, before and after the MLP), each
  Gemma's RMSNorm with weight (1 + w);
- a GeGLU MLP (tanh GELU);
- local (sliding-window) and global layers alternating (`layer_types`), softmax scale
  query_pre_attn_scalar ** -0.5, attention scores soft-capped by
  attn_logit_softcapping;
- final logits soft-capped by final_logit_softcapping: cap * tanh(logits / cap).

Checkpoint names are Llama's plus `pre_feedforward_layernorm` and
`post_feedforward_layernorm`. Gemma 3's text model (gemma3.py) is this decoder with
per-head q/k norms and a separate RoPE base for its local layers.
"""

from __future__ import annotations

import torch
from torch import nn

from flowengine.distributed.tp_group import SINGLE_RANK, TensorParallelGroup
from flowengine.model.attention.backend import AttentionBackend
from flowengine.model.attention.metadata import AttentionMetadata
from flowengine.model.layers.linear import ColumnParallelLinear, VocabParallelEmbedding
from flowengine.model.layers.rms_norm import GemmaRMSNorm
from flowengine.model.layers.rotary import RotaryEmbedding
from flowengine.model.model_config import ModelConfig
from flowengine.model.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP


class Gemma2DecoderLayer(nn.Module):
    """h = x + post_attn_norm(attn(input_norm(x))); out = h + post_ff_norm(mlp(pre_ff_norm(h))).

    Same residual protocol as LlamaDecoderLayer: returns (post_ff_norm(...), h) and the
    next layer (or the final norm) adds them.

    Args:
        is_sliding: this layer attends to the last config.sliding_window positions.
    """

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend,
                 tp: TensorParallelGroup, is_sliding: bool) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.is_sliding = is_sliding
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.self_attn = LlamaAttention(
            config, attn_backend, tp,
            sliding_window=config.sliding_window if is_sliding else None,
            logits_soft_cap=config.attn_logit_softcapping, norm_cls=GemmaRMSNorm)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.mlp = LlamaMLP(config, tp)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None, kv_cache: torch.Tensor,
                meta: AttentionMetadata, rotary: RotaryEmbedding
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) [T, hidden_size] each -> the same for the next layer."""
        x = hidden if residual is None else hidden + residual
        h = self.self_attn(positions, self.input_layernorm(x), kv_cache, meta, rotary)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return self.post_feedforward_layernorm(h), x


class Gemma2Model(nn.Module):
    """Scaled embedding, decoder layers, final Gemma norm; a global RoPE table and, when
    the config gives local layers their own base (Gemma 3), a local one."""

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend,
                 tp: TensorParallelGroup = SINGLE_RANK) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        sliding = set(config.sliding_layers)
        self.layers = nn.ModuleList(
            Gemma2DecoderLayer(config, attn_backend, tp, i in sliding)
            for i in range(config.num_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.embedding_multiplier = config.embedding_multiplier
        self.rotary_emb = RotaryEmbedding.from_config(config)
        self.rotary_local = (None if config.rope_local_theta is None else RotaryEmbedding(
            config.head_dim, config.max_model_len, config.rope_local_theta, None,
            rotary_dim=config.rotary_dim or None))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [T] int64 -> final-norm hidden states [T, hidden_size]."""
        # transformers rounds sqrt(hidden_size) to the model dtype before multiplying.
        scale = float(torch.tensor(self.embedding_multiplier, dtype=self.embed_tokens.weight.dtype))
        hidden = self.embed_tokens(input_ids) * scale
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            rotary = (self.rotary_local if layer.is_sliding and self.rotary_local is not None
                      else self.rotary_emb)
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta, rotary)
        if residual is None:  # no layers
            return self.norm(hidden)
        return self.norm.add_and_norm(hidden, residual)[0]


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2 over a paged KV cache; arguments and errors as LlamaForCausalLM. Loading
    and tensor-parallel shards are LlamaForCausalLM's (same parameter naming)."""

    def __init__(self, model_config: ModelConfig, attn_backend: AttentionBackend,
                 tp: TensorParallelGroup = SINGLE_RANK) -> None:
        nn.Module.__init__(self)
        self.config = model_config
        self.tp = tp
        self.model = Gemma2Model(model_config, attn_backend, tp)
        self.lm_head = (None if model_config.tie_word_embeddings else ColumnParallelLinear(
            model_config.hidden_size, self.model.embed_tokens.weight.shape[0], bias=False))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """As LlamaForCausalLM.compute_logits, then final soft-capping when configured."""
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        if logits is not None and cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
