"""The model's architecture, resolved once from a Hugging Face `config.json`.

`ModelConfig` is what the loader, the model and the KV cache sizing read; nothing
downstream touches the raw Hugging Face config. Both config dialects are understood:
transformers 4.x (`rope_theta` + `rope_scaling`, `torch_dtype`) and 5.x
(`rope_parameters`, `dtype`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from flowengine.model.layers.int4 import Int4QuantConfig

# Architectures FlowEngine serves; flowengine/model/models/__init__.py maps each to its
# model class (one file per family).
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "OlmoeForCausalLM",
    "GraniteForCausalLM",
    "Olmo2ForCausalLM",
    "Phi3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "BertModel",
)

# Encoder-only architectures: served by the pooling runner only (embeddings), with
# bidirectional attention and no KV cache (flowengine/model/models/bert.py).
ENCODER_ARCHITECTURES = ("BertModel",)

# Architectures whose sliding-window layers FlowEngine applies in attention (so the
# served length is not capped at the window).
_WINDOWED_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# Architectures whose every layer attends to the config's `sliding_window` (when set),
# applied in attention (flowengine/model/models/llama.py) and in the KV cache (blocks out
# of the window are freed: flowengine/core/sliding_window.py). Others of the Llama
# family that carry a window (Mixtral, Qwen2 with use_sliding_window) are still served
# up to the window only.
_ALL_SLIDING_ARCHITECTURES = ("MistralForCausalLM",)

_MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
                      "OlmoeForCausalLM")

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling.

    rope_type "linear": every inverse frequency divided by `factor` (Chen et al. 2023,
    "Extending Context Window ... via Positional Interpolation").
    rope_type "llama3": the piecewise rule of Meta's Llama 3.1 reference code
    (`apply_scaling` in llama/model.py), as transformers' `_compute_llama3_parameters`.
    """

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only causal LM: the Llama family (Llama 2/3, Mistral,
    Qwen2, Qwen3, SmolLM2) and its Mixture-of-Experts relatives (Mixtral, Qwen2-MoE,
    Qwen3-MoE, OLMoE).

    Sizes are counts; `head_dim` is per attention head; `max_model_len` is the longest
    sequence (prompt + output, in tokens) the engine accepts. `qkv_bias` / `o_bias` /
    `mlp_bias` say which projections carry a bias (Qwen2: q/k/v only); `qk_norm` adds an
    RMSNorm on queries and keys before RoPE: per head (Qwen3, `qk_norm_full` False) or
    over all heads' width at once (OLMoE, `qk_norm_full` True). `clip_qkv` clamps q, k and
    v to [-clip_qkv, clip_qkv] (OLMoE). `dtype` is the checkpoint's dtype, not
    necessarily the one the engine runs in (see `resolve_dtype`).

    Mixture of experts (`num_experts` > 0): each MoE layer routes a token to
    `num_experts_per_tok` of `num_experts` SwiGLU experts of width
    `moe_intermediate_size` (softmax over the router logits, top-k, renormalised to sum
    1 when `norm_topk_prob`); `shared_expert_intermediate_size` > 0 adds Qwen2-MoE's
    always-on shared expert with its sigmoid gate. Layers listed in `dense_layers` keep a
    dense MLP of width `intermediate_size` (Qwen's `mlp_only_layers` and
    `decoder_sparse_step`).

    RoPE: `rotary_dim` leading dimensions of each head are rotated (0: all of head_dim;
    Phi-4-mini's partial_rotary_factor 0.75). For scaled RoPE (linear, dynamic, yarn,
    longrope, llama3) `rope_inv_freq` [rotary_dim // 2] and `rope_attention_scaling`
    (yarn's and longrope's cos/sin factor) come from transformers'
    `ROPE_INIT_FUNCTIONS`; empty `rope_inv_freq`: the plain rule from `rope_theta`.
    Longrope also has `rope_long_inv_freq`, used for a whole step once a position in it
    reaches `rope_original_max_position` (transformers' and vLLM's rule).

    Gemma: `hidden_act` "gelu_pytorch_tanh" (GeGLU MLP); layers in `sliding_layers`
    attend to the last `sliding_window` positions only (and use `rope_local_theta`
    when set, Gemma 3's local layers); attention scores and final logits are
    soft-capped, cap * tanh(x / cap), by `attn_logit_softcapping` /
    `final_logit_softcapping` (Gemma 2).

    Granite's multipliers: embeddings times `embedding_multiplier`, each attention and
    MLP output times `residual_multiplier` before its residual add, softmax scale
    `attention_multiplier` (None: head_dim ** -0.5), logits divided by `logits_scaling`.
    """

    model_path: str
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    max_model_len: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    dtype: torch.dtype
    qk_norm_full: bool = False
    clip_qkv: float | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    dense_layers: tuple[int, ...] = ()
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    rotary_dim: int = 0
    rope_inv_freq: tuple[float, ...] = ()
    rope_attention_scaling: float = 1.0
    rope_long_inv_freq: tuple[float, ...] = ()
    rope_original_max_position: int = 0
    hidden_act: str = "silu"
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    rope_local_theta: float | None = None
    # BERT (encoder-only): token type embeddings; `rms_norm_eps` holds its layer_norm_eps.
    type_vocab_size: int = 0
    # A 4-bit GPTQ / AWQ checkpoint's `quantization_config` (flowengine/model/layers/int4.py),
    # or an FP8 checkpoint's (`Fp8CheckpointConfig`, flowengine/model/fp8_loader.py).
    quantization_config: Any = None
    # Place whole experts on the tensor-parallel ranks instead of splitting each one
    # (--enable-expert-parallel, an engine argument: set by engine/builder.py's resolve,
    # never read from config.json; flowengine/distributed/expert_parallel.py).
    enable_expert_parallel: bool = False

    @property
    def kv_sliding_window(self) -> int | None:
        """The window (tokens) when every layer slides it, else None: only then can KV
        blocks out of the window be freed (a global layer reads the whole context)."""
        if self.sliding_window is None or len(set(self.sliding_layers)) != self.num_layers:
            return None
        return self.sliding_window

    @property
    def is_encoder_only(self) -> bool:
        """An encoder (BERT): bidirectional attention, no KV cache, pooling runner only."""
        return self.architecture in ENCODER_ARCHITECTURES

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether decoder layer `layer_idx` has a mixture-of-experts MLP."""
        return self.num_experts > 0 and layer_idx not in self.dense_layers

    @property
    def eos_token_id(self) -> int | None:
        """The first EOS id (the one tokenizers append), or None when the model has none."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @classmethod
    def from_pretrained(
        cls, model_path: str, max_model_len: int | None = None, *, trust_remote_code: bool = False
    ) -> ModelConfig:
        """Read `config.json` (+ `generation_config.json` for EOS ids) from a local directory.

        trust_remote_code: let transformers run a config class the model ships (`auto_map`);
        without it such a config raises ValueError (transformers' message says so).
        Raises ValueError for an unsupported architecture or option, or a `max_model_len`
        the model cannot serve; OSError when `config.json` is missing or unreadable.
        """
        # Imported here: transformers takes seconds to import and most users of this
        # module only need the dataclass.
        from transformers import AutoConfig

        try:
            hf_config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        except ValueError as err:
            if trust_remote_code or "trust_remote_code" not in str(err):
                raise
            raise ValueError(
                f"the config of {model_path} is a class of the model repository's own code "
                "(auto_map in config.json); pass --trust-remote-code (trust_remote_code=True) "
                "to let transformers run it. FlowEngine still runs its own model forward."
            ) from err
        generation_eos = _generation_config_eos(model_path)
        return cls.from_hf_config(hf_config, model_path, max_model_len, generation_eos)

    @classmethod
    def from_hf_config(
        cls,
        hf_config: Any,
        model_path: str,
        max_model_len: int | None = None,
        extra_eos_token_ids: tuple[int, ...] = (),
    ) -> ModelConfig:
        """Resolve a `transformers.PretrainedConfig`. Errors as in `from_pretrained`."""
        architectures = list(getattr(hf_config, "architectures", None) or [])
        arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"model architecture {architectures or '(none given)'} of {model_path} is not "
                f"supported; FlowEngine serves {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if arch in ENCODER_ARCHITECTURES:
            return _bert_config(cls, hf_config, model_path, arch, max_model_len)
        is_gemma = arch in _WINDOWED_ARCHITECTURES
        act = (getattr(hf_config, "hidden_activation", None) if is_gemma else None) or getattr(
            hf_config, "hidden_act", "silu")
        if act != "silu" and not (is_gemma and act in ("gelu_pytorch_tanh", "gelu_tanh")):
            raise ValueError(f"hidden_act {act!r} is not supported for {arch} (only 'silu'"
                             f"{', gelu_pytorch_tanh' if is_gemma else ''})")
        num_heads = int(hf_config.num_attention_heads)
        num_kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or num_heads)
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads "
                f"{num_kv_heads}; the checkpoint's config.json is inconsistent"
            )
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        max_pos = int(hf_config.max_position_embeddings)
        rope_theta, rope_scaling, rope_fields = _rope(hf_config, int(head_dim), max_pos)
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        # Qwen2 (and Qwen2-MoE) always have q/k/v biases and never an o_proj bias
        # (modeling_qwen2.py); newer Qwen2-MoE configs spell it `qkv_bias`.
        window = _sliding_window(hf_config)
        all_sliding = arch in _ALL_SLIDING_ARCHITECTURES and window is not None
        is_qwen2 = arch == "Qwen2ForCausalLM" or (
            arch == "Qwen2MoeForCausalLM" and bool(getattr(hf_config, "qkv_bias", True)))
        return cls(
            model_path=str(model_path),
            architecture=arch,
            vocab_size=int(hf_config.vocab_size),
            hidden_size=int(hf_config.hidden_size),
            num_layers=int(hf_config.num_hidden_layers),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=int(head_dim),
            intermediate_size=int(hf_config.intermediate_size),
            rms_norm_eps=float(hf_config.rms_norm_eps),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            max_model_len=resolve_max_model_len(
                max_model_len, max_pos, None if is_gemma or all_sliding else window),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM",
                             "Olmo2ForCausalLM", "Gemma3ForCausalLM"),
            eos_token_ids=_eos_ids(getattr(hf_config, "eos_token_id", None), extra_eos_token_ids),
            bos_token_id=getattr(hf_config, "bos_token_id", None),
            dtype=_checkpoint_dtype(hf_config),
            qk_norm_full=arch in ("OlmoeForCausalLM", "Olmo2ForCausalLM"),
            clip_qkv=(None if getattr(hf_config, "clip_qkv", None) is None
                      else float(hf_config.clip_qkv)),
            **_moe_fields(hf_config, arch),
            **_granite_fields(hf_config, arch),
            **rope_fields,
            **(_gemma_fields(hf_config, arch) if is_gemma else {}),
            **(dict(sliding_window=window,
                    sliding_layers=tuple(range(int(hf_config.num_hidden_layers))))
               if all_sliding else {}),
            quantization_config=_quantization_config(hf_config),
        )


def _quantization_config(hf_config: Any) -> Any:
    """config.json's `quantization_config`: an `Int4QuantConfig` (GPTQ / AWQ), an
    `Fp8CheckpointConfig` (compressed-tensors / fp8), or None for a float checkpoint.
    Raises ValueError for a quantization FlowEngine cannot load (Int4QuantConfig.from_hf)."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict()
    from flowengine.model.fp8_loader import Fp8CheckpointConfig, is_fp8_quant_method

    if is_fp8_quant_method(qc):  # FP8 weights (flowengine/model/fp8_loader.py)
        return Fp8CheckpointConfig.from_hf(qc)
    return Int4QuantConfig.from_hf(qc)


def _bert_config(cls: type[ModelConfig], hf_config: Any, model_path: str, arch: str,
                 max_model_len: int | None) -> ModelConfig:
    """ModelConfig of a BERT encoder (transformers' BertConfig). Raises ValueError for
    relative position embeddings (only "absolute" is implemented)."""
    position_type = getattr(hf_config, "position_embedding_type", "absolute") or "absolute"
    if position_type != "absolute":
        raise ValueError(f"position_embedding_type {position_type!r} is not supported for "
                         f"{arch} (only 'absolute')")
    num_heads = int(hf_config.num_attention_heads)
    max_pos = int(hf_config.max_position_embeddings)
    return cls(
        model_path=str(model_path), architecture=arch, vocab_size=int(hf_config.vocab_size),
        hidden_size=int(hf_config.hidden_size), num_layers=int(hf_config.num_hidden_layers),
        num_heads=num_heads, num_kv_heads=num_heads,
        head_dim=int(hf_config.hidden_size) // num_heads,
        intermediate_size=int(hf_config.intermediate_size),
        rms_norm_eps=float(getattr(hf_config, "layer_norm_eps", 1e-12)),
        rope_theta=0.0, rope_scaling=None, max_position_embeddings=max_pos,
        max_model_len=resolve_max_model_len(max_model_len, max_pos),
        tie_word_embeddings=False, qkv_bias=True, o_bias=True, mlp_bias=True, qk_norm=False,
        eos_token_ids=(), bos_token_id=None, dtype=_checkpoint_dtype(hf_config),
        hidden_act=str(getattr(hf_config, "hidden_act", "gelu")),
        type_vocab_size=int(getattr(hf_config, "type_vocab_size", 2) or 0),
    )


def _gemma_fields(hf_config: Any, arch: str) -> dict[str, Any]:
    num_layers = int(hf_config.num_hidden_layers)
    layer_types = list(getattr(hf_config, "layer_types", None) or [])
    if not layer_types:  # configs before layer_types: Gemma 2 alternates, local first
        layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention"
                       for i in range(num_layers)]
    window = getattr(hf_config, "sliding_window", None)
    sliding = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
    params = getattr(hf_config, "rope_parameters", None) or {}
    local_theta = getattr(hf_config, "rope_local_base_freq", None)
    if "sliding_attention" in params:  # transformers 5: rope per layer type
        local_theta = params["sliding_attention"].get("rope_theta", local_theta)
    soft = getattr(hf_config, "attn_logit_softcapping", None)
    final = getattr(hf_config, "final_logit_softcapping", None)
    return dict(
        hidden_act="gelu_pytorch_tanh",
        sliding_window=None if window is None or not sliding else int(window),
        sliding_layers=sliding if window is not None else (),
        attn_logit_softcapping=None if soft is None else float(soft),
        final_logit_softcapping=None if final is None else float(final),
        rope_local_theta=(None if arch != "Gemma3ForCausalLM" or local_theta is None
                          else float(local_theta)),
        # sqrt(hidden_size) embedding scale and query_pre_attn_scalar ** -0.5 softmax scale
        embedding_multiplier=float(hf_config.hidden_size) ** 0.5,
        attention_multiplier=float(hf_config.query_pre_attn_scalar) ** -0.5,
    )


def _granite_fields(hf_config: Any, arch: str) -> dict[str, Any]:
    if arch != "GraniteForCausalLM":
        return {}
    return dict(embedding_multiplier=float(hf_config.embedding_multiplier),
                residual_multiplier=float(hf_config.residual_multiplier),
                attention_multiplier=float(hf_config.attention_multiplier),
                logits_scaling=float(hf_config.logits_scaling))


def _moe_fields(hf_config: Any, arch: str) -> dict[str, Any]:
    """The mixture-of-experts fields of ModelConfig from a Hugging Face config (empty for
    dense architectures). Raises ValueError for a config without experts."""
    if arch not in _MOE_ARCHITECTURES:
        return {}
    num_experts = getattr(hf_config, "num_local_experts", None) or getattr(
        hf_config, "num_experts", None)
    top_k = getattr(hf_config, "num_experts_per_tok", None)
    if not num_experts or not top_k or top_k > num_experts:
        raise ValueError(
            f"{arch} config needs num_experts >= num_experts_per_tok >= 1, got "
            f"num_experts={num_experts}, num_experts_per_tok={top_k}"
        )
    num_layers = int(hf_config.num_hidden_layers)
    if arch == "MixtralForCausalLM":
        # Mixtral: every layer is MoE, experts as wide as intermediate_size, and the
        # top-k probabilities are always renormalised (modeling_mixtral.py).
        return dict(num_experts=int(num_experts), num_experts_per_tok=int(top_k),
                    moe_intermediate_size=int(hf_config.intermediate_size),
                    norm_topk_prob=True)
    if arch == "OlmoeForCausalLM":
        return dict(num_experts=int(num_experts), num_experts_per_tok=int(top_k),
                    moe_intermediate_size=int(hf_config.intermediate_size),
                    norm_topk_prob=bool(getattr(hf_config, "norm_topk_prob", False)))
    # Qwen2-MoE / Qwen3-MoE: layer i is MoE unless listed in mlp_only_layers or
    # (i + 1) is not a multiple of decoder_sparse_step (modeling_qwen2_moe.py).
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    mlp_only = set(getattr(hf_config, "mlp_only_layers", None) or [])
    dense = tuple(i for i in range(num_layers) if i in mlp_only or (i + 1) % step)
    shared = 0
    if arch == "Qwen2MoeForCausalLM":
        shared = int(getattr(hf_config, "shared_expert_intermediate_size", 0) or 0)
    return dict(num_experts=int(num_experts), num_experts_per_tok=int(top_k),
                moe_intermediate_size=int(hf_config.moe_intermediate_size),
                norm_topk_prob=bool(getattr(hf_config, "norm_topk_prob", False)),
                shared_expert_intermediate_size=shared, dense_layers=dense)


def resolve_max_model_len(user_value: int | None, max_position_embeddings: int,
                          sliding_window: int | None = None) -> int:
    """The served context length in tokens.

    Defaults to `max_position_embeddings`, capped at the sliding window when the model
    has one: within the window, sliding-window attention equals full attention, so
    capping keeps outputs exact without a windowed kernel. Raises ValueError when the
    user asks for more than the model supports.
    """
    limit = max_position_embeddings
    reason = "max_position_embeddings"
    if sliding_window is not None and sliding_window < limit:
        limit, reason = sliding_window, "sliding window"
    if user_value is None:
        return limit
    if user_value > limit:
        raise ValueError(
            f"max_model_len {user_value} exceeds the model's {reason} ({limit}); "
            f"lower max_model_len to at most {limit}"
        )
    return user_value


def resolve_dtype(user_dtype: str, checkpoint_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype weights, activations and KV cache use.

    "auto": on CPU float32 (CPUs without AMX emulate half types, and float32 keeps
    outputs equal to Hugging Face's float32 reference); on CUDA the checkpoint's half
    dtype, or bfloat16 for a float32 checkpoint (vLLM's rule). Raises ValueError for an
    unknown name.
    """
    if user_dtype != "auto":
        if user_dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got {user_dtype!r}")
        return _DTYPES[user_dtype]
    if device.type == "cpu":
        return torch.float32
    return checkpoint_dtype if checkpoint_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16


_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


def _rope(hf_config: Any, head_dim: int, max_pos: int
          ) -> tuple[float, RopeScaling | None, dict[str, Any]]:
    """(rope_theta, rope_scaling, the ModelConfig RoPE fields) of a config."""
    # transformers 5 folds rope_theta into rope_parameters; 4.x keeps them apart.
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    params = dict(params or {})
    if "full_attention" in params:  # per layer type (Gemma 3): the global layers' RoPE
        params = dict(params["full_attention"])
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    theta = 10000.0 if theta is None else float(theta)
    partial = float(params.get("partial_rotary_factor",
                               getattr(hf_config, "partial_rotary_factor", None) or 1.0))
    rotary_dim = int(head_dim * partial)
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"partial_rotary_factor {partial} gives an odd or empty rotary "
                         f"dimension of head_dim {head_dim}")
    fields: dict[str, Any] = {"rotary_dim": rotary_dim if rotary_dim != head_dim else 0}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in _ROPE_TYPES:
        raise ValueError(
            f"RoPE scaling type {rope_type!r} is not supported; supported: "
            f"{', '.join(_ROPE_TYPES)}. Remove rope_scaling from config.json to serve at the "
            "original context length"
        )
    if rope_type == "default":
        return theta, None, fields
    params.update(rope_type=rope_type, rope_theta=theta, partial_rotary_factor=partial)
    original = params.get("original_max_position_embeddings",
                          getattr(hf_config, "original_max_position_embeddings", None))
    if original is not None:
        params["original_max_position_embeddings"] = int(original)
    inv_freq, attention_scaling = _hf_rope_init(params, head_dim, max_pos)
    fields.update(rope_inv_freq=inv_freq, rope_attention_scaling=attention_scaling)
    if rope_type == "longrope":
        if original is None:
            raise ValueError("longrope needs original_max_position_embeddings in config.json")
        long_freq, _ = _hf_rope_init(params, head_dim, max_pos, seq_len=int(original) + 1)
        fields.update(rope_long_inv_freq=long_freq, rope_original_max_position=int(original))
    if rope_type == "llama3":
        scaling = RopeScaling("llama3", float(params["factor"]), float(params["low_freq_factor"]),
                              float(params["high_freq_factor"]),
                              int(params["original_max_position_embeddings"]))
    else:
        scaling = RopeScaling(rope_type, float(params.get("factor") or 1.0))
    return theta, scaling, fields


class _RopeConfigView:
    """The few attributes transformers' ROPE_INIT_FUNCTIONS read from a config, so they
    run on 4.x-dialect configs and plain namespaces too: transformers 5 reads
    `rope_parameters`; 4.x reads `rope_scaling`, `rope_theta`, `partial_rotary_factor`
    and `original_max_position_embeddings` (same values)."""

    def __init__(self, params: dict[str, Any], head_dim: int, max_pos: int) -> None:
        self.rope_parameters = params
        self.rope_scaling = params
        self.rope_theta = params["rope_theta"]
        self.partial_rotary_factor = params["partial_rotary_factor"]
        if "original_max_position_embeddings" in params:
            self.original_max_position_embeddings = params["original_max_position_embeddings"]
        self.head_dim = head_dim
        self.hidden_size = head_dim
        self.num_attention_heads = 1
        self.max_position_embeddings = max_pos

    def standardize_rope_params(self) -> None:  # already in transformers 5's form
        pass


def _hf_rope_init(params: dict[str, Any], head_dim: int, max_pos: int,
                  seq_len: int | None = None) -> tuple[tuple[float, ...], float]:
    """Inverse frequencies (float32 values) and attention scaling from transformers'
    own RoPE initialisation for `params["rope_type"]` (modeling_rope_utils.py)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    fn = ROPE_INIT_FUNCTIONS[params["rope_type"]]
    try:
        inv_freq, attention_scaling = fn(_RopeConfigView(params, head_dim, max_pos), "cpu",
                                         seq_len=seq_len)
    except KeyError as err:
        raise ValueError(f"rope_scaling of type {params['rope_type']!r} lacks {err}; copy it "
                         "from the model's original config.json") from err
    return tuple(inv_freq.float().tolist()), float(attention_scaling)


def _sliding_window(hf_config: Any) -> int | None:
    window = getattr(hf_config, "sliding_window", None)
    if window is None:
        return None
    # Qwen2/Qwen3 carry a window but only apply it with use_sliding_window=True.
    if hasattr(hf_config, "use_sliding_window") and not hf_config.use_sliding_window:
        return None
    return int(window)


def _eos_ids(config_eos: int | list[int] | None, extra: tuple[int, ...]) -> tuple[int, ...]:
    ids: list[int] = []
    for value in (config_eos, list(extra)):
        for i in [value] if isinstance(value, int) else (value or []):
            if i not in ids:
                ids.append(int(i))
    return tuple(ids)


def _generation_config_eos(model_path: str) -> tuple[int, ...]:
    # Instruct models (Llama 3) list extra EOS ids (<|eot_id|>) only here.
    path = os.path.join(model_path, "generation_config.json")
    if not os.path.isfile(path):
        return ()
    with open(path, encoding="utf-8") as f:
        eos = json.load(f).get("eos_token_id")
    if eos is None:
        return ()
    return (eos,) if isinstance(eos, int) else tuple(eos)


def _checkpoint_dtype(hf_config: Any) -> torch.dtype:
    value = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(value, torch.dtype):
        return value
    return _DTYPES.get(str(value).removeprefix("torch."), torch.float32)
