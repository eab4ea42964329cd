"""The Llama family in plain PyTorch: Llama 2/3/3.x, Mistral, Qwen2, Qwen3, SmolLM2.

One decoder (Touvron et al. 2023, "LLaMA"): pre-norm RMSNorm, grouped-query attention
with RoPE, SwiGLU MLP. Family differences are config switches in `ModelConfig`: q/k/v
(and o) biases for Qwen2, per-head q/k RMSNorm for Qwen3, tied embeddings for SmolLM2,
RoPE scaling for Llama 3.1. Checkpoint tensors keep Hugging Face's names; q/k/v and
gate/up projections are fused into one matmul each (`qkv_proj`, `gate_up_proj`) and
filled shard by shard in `load_weights`. Operations run in Hugging Face's order so
float32 outputs match transformers' to rounding.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from flowengine.model.attention.backend import AttentionBackend
from flowengine.model.attention.metadata import AttentionMetadata
from flowengine.model.layers.activation import silu_and_mul
from flowengine.model.layers.rms_norm import RMSNorm
from flowengine.model.layers.rotary import RotaryEmbedding
from flowengine.model.model_config import ModelConfig

# Checkpoint tensors that are derived buffers in old Hugging Face checkpoints.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


class LlamaAttention(nn.Module):
    """Self-attention of one layer: fused qkv projection, RoPE, paged attention, o_proj."""

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim ** -0.5
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.qk_norm = config.qk_norm
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.attn_backend = attn_backend

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, rotary: RotaryEmbedding) -> torch.Tensor:
        """hidden [T, hidden_size] -> [T, hidden_size]; writes this layer's K/V."""
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        qk_end = self.q_size + self.kv_size
        q = qkv[:, :self.q_size].view(num_tokens, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size:qk_end].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary.rotate_qk(positions, q, k)
        v = qkv[:, qk_end:].view(num_tokens, self.num_kv_heads, self.head_dim)
        attn = self.attn_backend.forward(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(attn.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x)), gate and up fused in one matmul."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size,
                                      bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size,
                                   bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden_size] -> [T, hidden_size]."""
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)).

    The residual stream travels beside the hidden states (vLLM's layout), so that each
    residual add is fused into the norm that follows it.
    """

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, attn_backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None, kv_cache: torch.Tensor,
                meta: AttentionMetadata, rotary: RotaryEmbedding
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) [T, hidden_size] each -> the same for the next layer; the
        layer's output is their sum. residual None: `hidden` is the whole input (first
        layer). Writes this layer's K/V."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta, rotary)
        hidden, residual = self.post_attention_layernorm.add_and_norm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm; one RoPE table shared by all layers."""

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, attn_backend) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.max_model_len,
                                          config.rope_theta, config.rope_scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [T] int64 -> final-norm hidden states [T, hidden_size]."""
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta,
                                     self.rotary_emb)
        if residual is None:  # no layers
            return self.norm(hidden)
        return self.norm.add_and_norm(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    """Causal LM over a paged KV cache.

    Args:
        model_config: the resolved architecture.
        attn_backend: computes attention and KV-cache writes (see AttentionBackend).
    """

    def __init__(self, model_config: ModelConfig, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.config = model_config
        self.model = LlamaModel(model_config, attn_backend)
        # Tied models read the embedding matrix in compute_logits: no second Parameter
        # to keep tied (Module.to_empty would silently untie a shared one).
        self.lm_head = (None if model_config.tie_word_embeddings else
                        nn.Linear(model_config.hidden_size, model_config.vocab_size, bias=False))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_metadata: AttentionMetadata) -> torch.Tensor:
        """One step over a flattened batch.

        Args:
            input_ids: [T] int64 token ids; positions: [T] int64 positions in their sequence
                (each < max_model_len).
            kv_caches: one [2, num_blocks, block_size, num_kv_heads, head_dim] tensor per
                layer, written in place at attn_metadata.slot_mapping.
            attn_metadata: the step's AttentionMetadata.

        Returns:
            [T, hidden_size] final-norm hidden states, model dtype.
        """
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, hidden_size] -> logits [R, vocab_size] float32."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def expected_weight_names(self) -> set[str]:
        """The Hugging Face tensor names a complete checkpoint provides."""
        names: set[str] = set()
        for name, _ in self.named_parameters():
            for hf_name, _, _ in self._checkpoint_names(name):
                names.add(hf_name)
        return names

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (Hugging Face names) into the parameters.

        Casts to the parameter dtype/device. Returns the names loaded. Raises ValueError
        listing tensors the model has no place for, or a tensor whose shape disagrees
        with config.json.
        """
        targets: dict[str, tuple[str, int, int]] = {}
        for name, _ in self.named_parameters():
            for hf_name, start, end in self._checkpoint_names(name):
                targets[hf_name] = (name, start, end)
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        unexpected: list[str] = []
        for hf_name, tensor in weights:
            if hf_name.endswith(_IGNORED_SUFFIXES) or (
                hf_name == "lm_head.weight" and self.lm_head is None
            ):
                continue
            if hf_name not in targets:
                unexpected.append(hf_name)
                continue
            name, start, end = targets[hf_name]
            dest = params[name][start:end] if end > 0 else params[name]
            if dest.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {hf_name} has shape {tuple(tensor.shape)} but the "
                    f"model built from config.json expects {tuple(dest.shape)}; the weights "
                    "do not belong to this config.json"
                )
            dest.copy_(tensor)
            loaded.add(hf_name)
        if unexpected:
            raise ValueError(
                f"checkpoint has {len(unexpected)} tensor(s) this {self.config.architecture} "
                f"model has no place for: {sorted(unexpected)[:20]}; check that config.json "
                "matches the weights"
            )
        return loaded

    def _checkpoint_names(self, param_name: str) -> list[tuple[str, int, int]]:
        """(hf_name, row_start, row_end) shards of one parameter; end 0 = whole tensor."""
        prefix, _, leaf = param_name.rpartition(".")  # leaf: "weight" / "bias"
        c = self.config
        if prefix.endswith("self_attn.qkv_proj"):
            base = prefix.removesuffix("qkv_proj")
            q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
            return [(f"{base}q_proj.{leaf}", 0, q), (f"{base}k_proj.{leaf}", q, q + kv),
                    (f"{base}v_proj.{leaf}", q + kv, q + 2 * kv)]
        if prefix.endswith("mlp.gate_up_proj"):
            base = prefix.removesuffix("gate_up_proj")
            i = c.intermediate_size
            return [(f"{base}gate_proj.{leaf}", 0, i), (f"{base}up_proj.{leaf}", i, 2 * i)]
        return [(param_name, 0, 0)]
