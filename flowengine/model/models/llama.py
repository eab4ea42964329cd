"""The Llama family in plain PyTorch: Llama 2/3/3.x, Mistral, Qwen2, Qwen3, SmolLM2.

The decoder here is also the base of the mixture-of-experts families (mixtral.py,
qwen2_moe.py, qwen3_moe.py, olmoe.py), which replace the MLP of some or all layers
(`LlamaForCausalLM.make_mlp`) and keep everything else.

One decoder (Touvron et al. 2023, "LLaMA"): pre-norm RMSNorm, grouped-query attention
with RoPE, SwiGLU MLP. Family differences are config switches in `ModelConfig`: q/k/v
(and o) biases for Qwen2, per-head q/k RMSNorm for Qwen3, tied embeddings for SmolLM2,
RoPE scaling for Llama 3.1. Checkpoint tensors keep Hugging Face's names; q/k/v and
gate/up projections are fused into one matmul each (`qkv_proj`, `gate_up_proj`) and
filled shard by shard in `load_weights`. Operations run in Hugging Face's order so
float32 outputs match transformers' to rounding.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from flowengine.distributed.tp_group import SINGLE_RANK, TensorParallelGroup
from flowengine.model.attention.backend import AttentionBackend
from flowengine.model.attention.metadata import AttentionMetadata
from flowengine.model.layers import cpu_fused
from flowengine.model.layers.activation import gelu_tanh_and_mul, silu_and_mul
from flowengine.model.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    parallel_logits,
)
from flowengine.model.layers.moe import FusedMoE
from flowengine.model.layers.quant_linear import swiglu_bf16_gemms
from flowengine.model.layers.rms_norm import RMSNorm, ShardedRMSNorm
from flowengine.model.layers.rotary import RotaryEmbedding
from flowengine.model.model_config import ModelConfig
from flowengine.model.weight_shards import WeightShard, read_shard, tensor_shape

# Checkpoint tensors that are derived buffers in old Hugging Face checkpoints.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


class LlamaAttention(nn.Module):
    """Self-attention of one layer: fused qkv projection, RoPE, paged attention, o_proj.

    Under tensor parallelism each rank holds num_heads / N query heads and
    num_kv_heads / N KV heads (its qkv rows and o_proj columns); o_proj sums the ranks.
    """

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend,
                 tp: TensorParallelGroup = SINGLE_RANK, *, sliding_window: int | None = None,
                 logits_soft_cap: float | None = None,
                 norm_cls: type[RMSNorm] = RMSNorm) -> None:
        super().__init__()
        self.num_heads = tp.shard(config.num_heads, "num_attention_heads")[1]
        self.num_kv_heads = tp.shard(config.num_kv_heads, "num_key_value_heads")[1]
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * config.head_dim
        self.kv_size = self.num_kv_heads * config.head_dim
        self.scale = (config.head_dim ** -0.5 if config.attention_multiplier is None
                      else config.attention_multiplier)  # Granite
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, self.q_size + 2 * self.kv_size,
                                             bias=config.qkv_bias)
        self.o_proj = RowParallelLinear(self.q_size, config.hidden_size, config.o_bias, tp)
        self.qk_norm = config.qk_norm
        self.qk_norm_full = config.qk_norm_full
        if config.qk_norm_full:  # OLMoE: one norm over all heads' width
            eps = config.rms_norm_eps
            self.q_norm = ShardedRMSNorm(config.num_heads * config.head_dim, self.q_size, eps, tp)
            self.k_norm = ShardedRMSNorm(config.num_kv_heads * config.head_dim, self.kv_size,
                                         eps, tp)
        elif config.qk_norm:
            self.q_norm = norm_cls(config.head_dim, config.rms_norm_eps)
            self.k_norm = norm_cls(config.head_dim, config.rms_norm_eps)
        self.clip_qkv = config.clip_qkv
        self.attn_backend = attn_backend
        # Passed to the backend only when set, so backends without them serve the rest.
        self.attn_kwargs: dict[str, float | int] = {}
        if sliding_window is not None:
            self.attn_kwargs["sliding_window"] = sliding_window
        if logits_soft_cap is not None:
            self.attn_kwargs["logits_soft_cap"] = logits_soft_cap

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, rotary: RotaryEmbedding) -> torch.Tensor:
        """hidden [T, hidden_size] -> [T, hidden_size]; writes this layer's K/V."""
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        qk_end = self.q_size + self.kv_size
        q, k, v = qkv[:, :self.q_size], qkv[:, self.q_size:qk_end], qkv[:, qk_end:]
        if self.qk_norm_full:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:  # after OLMoE's norm, as modeling_olmoe.py
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        # A backend that fuses RoPE into its KV write takes the tables (one launch less),
        # and Qwen3's per-head q/k RMSNorm too when it can (two less).
        tables = (rotary.kernel_tables(positions, q)
                  if getattr(self.attn_backend, "fuses_rotary", False) else None)
        per_head_norm = self.qk_norm and not self.qk_norm_full
        fused_norm = None
        if (per_head_norm and tables is not None and type(self.q_norm) is RMSNorm
                and getattr(self.attn_backend, "fuses_qk_norm", False)):
            fused_norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        elif per_head_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if tables is None:
            q, k = rotary.rotate_qk(positions, q, k)
            attn = self.attn_backend.forward(q, k, v, kv_cache, meta, self.scale,
                                             **self.attn_kwargs)
        elif fused_norm is None:
            attn = self.attn_backend.forward(q, k, v, kv_cache, meta, self.scale,
                                             rotary=tables, **self.attn_kwargs)
        else:
            attn = self.attn_backend.forward(q, k, v, kv_cache, meta, self.scale,
                                             rotary=tables, qk_norm=fused_norm,
                                             **self.attn_kwargs)
        return self.o_proj(attn.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x)), gate and up fused in one matmul.

    Under tensor parallelism each rank holds intermediate_size / N columns of gate and
    up and the matching rows of down; down_proj sums the ranks.
    """

    def __init__(self, config: ModelConfig, tp: TensorParallelGroup = SINGLE_RANK,
                 intermediate_size: int | None = None) -> None:
        super().__init__()
        # Full width (intermediate_size by default; Qwen2-MoE's shared expert has its own).
        self.intermediate_size = intermediate_size or config.intermediate_size
        inter = tp.shard(self.intermediate_size, "intermediate_size")[1]
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, 2 * inter,
                                                 bias=config.mlp_bias)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, config.mlp_bias, tp)
        # GeGLU (tanh GELU) for Gemma, SwiGLU for the rest.
        self.act = gelu_tanh_and_mul if config.hidden_act == "gelu_pytorch_tanh" else silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden_size] -> [T, hidden_size]."""
        if self.act is silu_and_mul:
            out = swiglu_bf16_gemms(x, self.gate_up_proj, self.down_proj)
            if out is not None:  # a CPU prefill over bf16 GEMMs, its [T, 2I] kept bf16
                return out
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)).

    The residual stream travels beside the hidden states (vLLM's layout), so that each
    residual add is fused into the norm that follows it.
    """

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend,
                 tp: TensorParallelGroup = SINGLE_RANK, mlp: nn.Module | None = None,
                 mlp_name: str = "mlp") -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Mistral: every layer slides the same window (ModelConfig.kv_sliding_window).
        self.self_attn = LlamaAttention(config, attn_backend, tp,
                                        sliding_window=config.kv_sliding_window)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # The checkpoint's name for the MLP (Mixtral: "block_sparse_moe").
        self.mlp_name = mlp_name
        setattr(self, mlp_name, LlamaMLP(config, tp) if mlp is None else mlp)
        self.residual_multiplier = config.residual_multiplier  # Granite; 1 elsewhere

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
        if self.residual_multiplier != 1.0:
            hidden = hidden * self.residual_multiplier
        hidden, residual = self.post_attention_layernorm.add_and_norm(hidden, residual)
        hidden = getattr(self, self.mlp_name)(hidden)
        if self.residual_multiplier != 1.0:
            hidden = hidden * self.residual_multiplier
        return hidden, residual


class PPMissingLayer(nn.Identity):
    """The place of a module another pipeline stage holds (vLLM's name): no weights, so
    the layer indices and parameter names of the stage's own modules stay those of the
    checkpoint."""


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm; one RoPE table shared by all layers.

    Under pipeline parallelism (`LlamaForCausalLM.keep_pipeline_stage`) it holds only
    layers [start_layer, end_layer), the embedding on the first stage (and the last,
    for tied embeddings) and the final norm on the last.
    """

    def __init__(self, config: ModelConfig, attn_backend: AttentionBackend,
                 tp: TensorParallelGroup = SINGLE_RANK,
                 make_mlp: Callable[[int], nn.Module | None] | None = None,
                 mlp_name: str = "mlp", layer_cls: type[nn.Module] | None = None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        layer_cls = LlamaDecoderLayer if layer_cls is None else layer_cls
        self.layers = nn.ModuleList(
            layer_cls(config, attn_backend, tp, None if make_mlp is None else make_mlp(i),
                      mlp_name)
            for i in range(config.num_layers)
        )
        self.embedding_multiplier = config.embedding_multiplier  # Granite; 1 elsewhere
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding.from_config(config)
        # The pipeline stage's share (all of the model without pipeline parallelism).
        self.start_layer, self.end_layer = 0, config.num_layers
        self.is_first_stage = self.is_last_stage = True
        # EAGLE-3 (executor/eagle_runner.py): layers whose input the forward can also
        # return (the residual stream before layer i, i.e. after layer i - 1).
        self.aux_hidden_state_layers: tuple[int, ...] = ()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                intermediate: torch.Tensor | None = None,
                aux_hidden_states: list[torch.Tensor] | None = None) -> torch.Tensor:
        """input_ids, positions [T] int64 -> final-norm hidden states [T, hidden_size].

        Pipeline stages: kv_caches holds one tensor per layer of the stage;
        `intermediate` is the previous stage's output (None on the first stage, which
        embeds input_ids); a stage other than the last returns [2, T, hidden_size]:
        the hidden states and the residual stream after its last layer.
        aux_hidden_states: an optional output; when given, the input of each layer in
        `aux_hidden_state_layers` ([T, hidden_size], pre-norm) is appended, in order
        (layer numbers are the whole model's).
        """
        if intermediate is None and aux_hidden_states is None and input_ids.device.type == "cpu":
            # quantized CPU decode: every layer in one C call (layers/cpu_fused.py)
            fused = cpu_fused.decode_forward(self, input_ids, positions, kv_caches, meta)
            if fused is not None:
                return fused
        if intermediate is None:
            hidden = self.embed_tokens(input_ids)
            if self.embedding_multiplier != 1.0:
                hidden = hidden * self.embedding_multiplier
            residual = None
        else:
            hidden, residual = intermediate[0], intermediate[1]
        aux_layers = self.aux_hidden_state_layers if aux_hidden_states is not None else ()
        layers = itertools.islice(self.layers, self.start_layer, self.end_layer)
        for i, (layer, kv_cache) in enumerate(zip(layers, kv_caches, strict=True),
                                              start=self.start_layer):
            if i in aux_layers:
                aux_hidden_states.append(hidden if residual is None else hidden + residual)
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta,
                                     self.rotary_emb)
        if not self.is_last_stage:
            return torch.stack((hidden, residual))
        if residual is None:  # no layers
            return self.norm(hidden)
        return self.norm.add_and_norm(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    """Causal LM over a paged KV cache.

    Args:
        model_config: the resolved architecture.
        attn_backend: computes attention and KV-cache writes (see AttentionBackend).
        tp: the tensor-parallel group; this rank builds and loads only its shard.

    Raises:
        ValueError: head counts or intermediate_size not divisible by tp.world_size.
    """

    # The checkpoint's name of each layer's MLP module, and the decoder layer class
    # (same constructor and forward as LlamaDecoderLayer).
    mlp_name = "mlp"
    decoder_layer_cls: type[nn.Module] | None = None
    # Checkpoints store q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj`
    # tensor (Phi-3) rather than separately (Llama).
    fused_checkpoint = False

    def __init__(self, model_config: ModelConfig, attn_backend: AttentionBackend,
                 tp: TensorParallelGroup = SINGLE_RANK) -> None:
        super().__init__()
        self.config = model_config
        self.tp = tp
        self.model = LlamaModel(model_config, attn_backend, tp, self.make_mlp, self.mlp_name,
                                self.decoder_layer_cls)
        # Tied models read the embedding matrix in compute_logits: no second Parameter
        # to keep tied (Module.to_empty would silently untie a shared one). The LM head
        # is split by vocabulary rows like the embedding.
        self.lm_head = (None if model_config.tie_word_embeddings else ColumnParallelLinear(
            model_config.hidden_size, self.model.embed_tokens.weight.shape[0], bias=False))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_metadata: AttentionMetadata,
                aux_hidden_states: list[torch.Tensor] | None = None) -> torch.Tensor:
        """One step over a flattened batch.

        Args:
            input_ids: [T] int64 token ids; positions: [T] int64 positions in their sequence
                (each < max_model_len).
            kv_caches: one [2, num_blocks, block_size, num_kv_heads, head_dim] tensor per
                layer, written in place at attn_metadata.slot_mapping.
            attn_metadata: the step's AttentionMetadata.
            aux_hidden_states: optional output list (EAGLE-3): gets the pre-norm input of
                each layer of `model.aux_hidden_state_layers`, [T, hidden_size] each.

        Returns:
            [T, hidden_size] final-norm hidden states, model dtype.
        """
        if aux_hidden_states is None:
            return self.model(input_ids, positions, kv_caches, attn_metadata)
        return self.model(input_ids, positions, kv_caches, attn_metadata,
                          aux_hidden_states=aux_hidden_states)

    def forward_stage(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      kv_caches: list[torch.Tensor], attn_metadata: AttentionMetadata,
                      intermediate: torch.Tensor | None) -> torch.Tensor:
        """One pipeline stage's part of `forward`: from the previous stage's
        [2, T, hidden_size] hidden states and residual (None on the first stage), to
        the same for the next stage, or, on the last stage, the final-norm hidden
        states [T, hidden_size]. kv_caches: one tensor per layer of the stage."""
        return self.model(input_ids, positions, kv_caches, attn_metadata, intermediate)

    def keep_pipeline_stage(self, start_layer: int, end_layer: int, is_first: bool,
                            is_last: bool) -> None:
        """Drop what other pipeline stages hold, before weights are materialized (on
        the meta device): decoder layers outside [start_layer, end_layer), the
        embedding unless first (or last with tied embeddings: the LM head reads it),
        the final norm and LM head unless last. Their checkpoint tensors are then
        skipped by `load_weights`.

        Raises ValueError for a model family whose decoder is not LlamaModel's.
        """
        model = self.model
        if type(model) is not LlamaModel:
            raise ValueError(f"pipeline parallelism is not supported for "
                             f"{self.config.architecture} models yet; serve it with "
                             "pipeline_parallel_size 1")
        for i in range(len(model.layers)):
            if not start_layer <= i < end_layer:
                model.layers[i] = PPMissingLayer()
        if not is_first and not (is_last and self.lm_head is None):
            model.embed_tokens = PPMissingLayer()
        if not is_last:
            model.norm = PPMissingLayer()
            self.lm_head = PPMissingLayer()
        model.start_layer, model.end_layer = start_layer, end_layer
        model.is_first_stage, model.is_last_stage = is_first, is_last
        self._stage_skipped = self._missing_prefixes()

    def _missing_prefixes(self) -> tuple[str, ...]:
        """Checkpoint name prefixes of the modules `keep_pipeline_stage` dropped."""
        prefixes = [f"model.layers.{i}." for i, layer in enumerate(self.model.layers)
                    if isinstance(layer, PPMissingLayer)]
        if isinstance(self.model.embed_tokens, PPMissingLayer):
            prefixes.append("model.embed_tokens.")
        if isinstance(self.model.norm, PPMissingLayer):
            prefixes += ["model.norm.", "lm_head."]
        return tuple(prefixes)

    def make_mlp(self, layer_idx: int) -> nn.Module | None:
        """The MLP of decoder layer `layer_idx`; None: the dense SwiGLU LlamaMLP. Families
        with mixture-of-experts layers override this."""
        return None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [R, hidden_size] -> logits [R, vocab_size] float32 on rank 0 (None on
        the other tensor-parallel ranks, which send their vocabulary slice to rank 0)."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = parallel_logits(hidden, weight, self.config.vocab_size, self.tp)
        if logits is not None and self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling  # Granite
        return logits

    def expected_weight_names(self) -> set[str]:
        """The Hugging Face tensor names a complete checkpoint provides."""
        return {shard.hf_name for shard in self.weight_shards()}

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Copy this rank's slice of each checkpoint tensor (Hugging Face names) into the
        parameters (a fused tensor, or a per-expert one, may fill parts of several).

        `weights` yields (name, torch.Tensor or safetensors lazy slice). Casts to the
        parameter dtype/device. Returns the names loaded. Raises ValueError listing
        tensors the model has no place for, or a tensor whose shape disagrees with
        config.json.
        """
        targets: dict[str, list[WeightShard]] = {}
        for shard in self.weight_shards():  # a fused tensor feeds several shards
            targets.setdefault(shard.hf_name, []).append(shard)
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        unexpected: list[str] = []
        # Experts other expert-parallel ranks hold: in the checkpoint, not read here.
        elsewhere = self.other_ranks_weight_names()
        skipped = getattr(self, "_stage_skipped", ())  # other pipeline stages' tensors
        for hf_name, tensor in weights:
            if hf_name.endswith(_IGNORED_SUFFIXES) or (
                hf_name == "lm_head.weight" and self.lm_head is None
            ) or (skipped and hf_name.startswith(skipped)):
                continue
            shards = targets.get(hf_name)
            if shards is None and hf_name in elsewhere:
                continue
            if shards is None:
                unexpected.append(hf_name)
                continue
            for shard in shards:
                if tensor_shape(tensor) != shard.full_shape:
                    raise ValueError(
                        f"checkpoint tensor {hf_name} has shape {tensor_shape(tensor)} but the "
                        f"model built from config.json expects {shard.full_shape}; the weights "
                        "do not belong to this config.json"
                    )
                param = params[shard.param]
                shard.destination(param).copy_(read_shard(tensor, shard))
                if shard.param.endswith(("embed_tokens.weight", "lm_head.weight")):
                    param[shard.length:].zero_()  # vocabulary padding rows of the last rank
            loaded.add(hf_name)
        if unexpected:
            raise ValueError(
                f"checkpoint has {len(unexpected)} tensor(s) this {self.config.architecture} "
                f"model has no place for: {sorted(unexpected)[:20]}; check that config.json "
                "matches the weights"
            )
        return loaded

    def other_ranks_weight_names(self) -> set[str]:
        """Checkpoint tensors of experts that other expert-parallel ranks hold (empty
        without expert parallelism)."""
        names: set[str] = set()
        for prefix, module in self.named_modules():
            if isinstance(module, FusedMoE):
                names |= module.other_ranks_weight_names(prefix)
        return names

    def weight_shards(self) -> list[WeightShard]:
        """Every checkpoint tensor this rank reads, with its slice and destination, in
        parameter order (see flowengine/model/weight_shards.py)."""
        c, tp = self.config, self.tp
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        q_start, q_len = tp.shard(q, "num_attention_heads * head_dim")
        kv_start, kv_len = tp.shard(kv, "num_key_value_heads * head_dim")
        v_start, _, v_len = tp.padded_shard(c.vocab_size)
        modules = dict(self.named_modules())
        shards: list[WeightShard] = []
        for name, param in self.named_parameters():
            prefix, _, leaf = name.rpartition(".")  # leaf: "weight" / "bias"
            cols = (c.hidden_size,) if leaf == "weight" else ()
            module, parent = modules[prefix], modules.get(prefix.rpartition(".")[0])
            if isinstance(module, FusedMoE):
                if leaf == "w13_weight":  # one call covers both stacked parameters
                    shards += module.weight_shards(prefix)
            elif c.qk_norm_full and prefix.endswith(("self_attn.q_norm", "self_attn.k_norm")):
                start, length, width = ((q_start, q_len, q) if prefix.endswith("q_norm")
                                        else (kv_start, kv_len, kv))
                shards.append(WeightShard(name, name, (width,), 0, start, length, 0))
            elif prefix.endswith("self_attn.qkv_proj") and self.fused_checkpoint:
                full = (q + 2 * kv, *cols)
                shards += [WeightShard(name, name, full, 0, q_start, q_len, 0),
                           WeightShard(name, name, full, 0, q + kv_start, kv_len, q_len),
                           WeightShard(name, name, full, 0, q + kv + kv_start, kv_len,
                                       q_len + kv_len)]
            elif prefix.endswith("self_attn.qkv_proj"):
                base = prefix.removesuffix("qkv_proj")
                shards += [
                    WeightShard(f"{base}q_proj.{leaf}", name, (q, *cols), 0, q_start, q_len, 0),
                    WeightShard(f"{base}k_proj.{leaf}", name, (kv, *cols), 0, kv_start, kv_len,
                                q_len),
                    WeightShard(f"{base}v_proj.{leaf}", name, (kv, *cols), 0, kv_start, kv_len,
                                q_len + kv_len),
                ]
            elif isinstance(parent, LlamaMLP) and prefix.endswith(".gate_up_proj"):
                inter = parent.intermediate_size
                i_start, i_len = tp.shard(inter, "intermediate_size")
                if self.fused_checkpoint:  # one [2 * inter, ...] tensor: gate rows, up rows
                    full = (2 * inter, *cols)
                    shards += [WeightShard(name, name, full, 0, i_start, i_len, 0),
                               WeightShard(name, name, full, 0, inter + i_start, i_len, i_len)]
                else:
                    base = prefix.removesuffix("gate_up_proj")
                    full = (inter, *cols)
                    shards += [
                        WeightShard(f"{base}gate_proj.{leaf}", name, full, 0, i_start, i_len, 0),
                        WeightShard(f"{base}up_proj.{leaf}", name, full, 0, i_start, i_len,
                                    i_len),
                    ]
            elif leaf == "weight" and (prefix.endswith("self_attn.o_proj") or (
                    isinstance(parent, LlamaMLP) and prefix.endswith(".down_proj"))):
                if isinstance(parent, LlamaMLP):
                    width = parent.intermediate_size
                    start, length = tp.shard(width, "intermediate_size")
                else:
                    start, length, width = q_start, q_len, q
                shards.append(WeightShard(name, name, (c.hidden_size, width), 1, start, length))
            elif name in ("model.embed_tokens.weight", "lm_head.weight"):
                shards.append(WeightShard(name, name, (c.vocab_size, c.hidden_size), 0,
                                          v_start, v_len, 0))
            else:  # norms, o/down biases, MoE routers and shared-expert gates: whole
                shards.append(WeightShard(name, name, tuple(param.shape)))
        return shards
