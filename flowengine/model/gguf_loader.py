"""Read GGUF checkpoints (llama.cpp's format) as Hugging Face tensors and config.

Tensors are dequantized with `gguf.quants.dequantize` to float32, reshaped to
Hugging Face's shapes (GGUF lists dimensions fastest-first, i.e. reversed) and renamed
to Hugging Face names. llama.cpp's converter (`convert_hf_to_gguf.py`,
`LlamaModel.permute`) reorders the rows of Llama q/k projections from the rotate-half
layout to llama.cpp's interleaved-pair layout; `unpermute_qk` undoes that. Qwen2/Qwen3
are stored unpermuted. The config comes from the `{arch}.*` metadata keys.

For weights kept quantized (`--quantization gguf`), `iter_gguf_tensors` yields the
tensors it is asked to keep as `PackedTensor`s (flowengine/model/layers/quant_linear.py)
in their own block format (Q4_0, Q4_1, Q8_0; Q4_K as Q4_1 blocks with the same codes),
rows unpermuted like the float ones.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

# GGUF architecture -> (Hugging Face architecture, model_type, q/k rows permuted).
_ARCHES: dict[str, tuple[str, str, bool]] = {
    "llama": ("LlamaForCausalLM", "llama", True),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", False),
}

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

# llama.cpp stores Llama 3.1-style RoPE scaling only as per-frequency factors
# (tensor "rope_freqs"); these are the (low_freq_factor, high_freq_factor,
# original_max_position_embeddings) of every Meta release that uses it.
_LLAMA3_ROPE_CANDIDATES = ((1.0, 4.0, 8192),)


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `LlamaModel.permute` for a q/k weight or bias.

    weight: [num_heads * head_dim, ...] in llama.cpp row order, where row (h, i, s)
    holds Hugging Face row (h, s, i) for s in {0, 1} (which half), i < head_dim // 2.
    Returns the same shape in Hugging Face's rotate-half row order.
    """
    half = weight.shape[0] // num_heads // 2
    return (weight.reshape(num_heads, half, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def hf_tensor_name(gguf_name: str) -> str | None:
    """Hugging Face name for a GGUF tensor name; None for names with no HF tensor."""
    stem, _, kind = gguf_name.rpartition(".")
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{kind}"
    match = _LAYER_RE.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.{match.group(3)}"
    return None


def open_gguf(path: str) -> Any:
    """A `gguf.GGUFReader` over `path` (memory-mapped). Raises ValueError for a bad file."""
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except (ValueError, OSError) as e:
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e


def gguf_architecture(reader: Any) -> tuple[str, str, bool]:
    """(GGUF arch, Hugging Face architecture, q/k permuted); ValueError if unsupported."""
    arch = _field(reader, "general.architecture", None)
    if arch not in _ARCHES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; FlowEngine reads "
            f"{', '.join(_ARCHES)} GGUF files (pass the Hugging Face checkpoint instead)"
        )
    hf_arch, _, permuted = _ARCHES[arch]
    return arch, hf_arch, permuted


def gguf_hf_config(reader: Any) -> Any:
    """A `transformers.PretrainedConfig` equivalent to the GGUF metadata.

    Float32 (the dequantized weights), tied embeddings when the file has no
    `output.weight`. Raises ValueError for an unsupported architecture or RoPE scaling.
    """
    from transformers import AutoConfig

    arch, hf_arch, _ = gguf_architecture(reader)
    tensors = {t.name: t for t in reader.tensors}
    embed_rows = int(tensors["token_embd.weight"].shape[-1])
    num_heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // num_heads))
    rope_theta = _as_decimal(_field(reader, f"{arch}.rope.freq_base", 10000.0))
    kwargs: dict[str, Any] = dict(
        architectures=[hf_arch],
        vocab_size=int(_field(reader, f"{arch}.vocab_size", embed_rows)),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_hidden_layers=int(_field(reader, f"{arch}.block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        max_position_embeddings=int(_field(reader, f"{arch}.context_length")),
        rms_norm_eps=_as_decimal(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=rope_theta,
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id", None),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id", None),
    )
    if arch == "llama":
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in tensors
    scaling = _rope_scaling(reader, arch, tensors, head_dim, rope_theta)
    if scaling is not None:
        kwargs["rope_scaling"] = scaling
    config = AutoConfig.for_model(_ARCHES[arch][1], **kwargs)
    # transformers 5 names the field `dtype`, 4.x `torch_dtype`.
    setattr(config, "dtype" if hasattr(config, "dtype") else "torch_dtype", torch.float32)
    return config


# GGUF tensor types FlowEngine's CPU kernels run without dequantizing, and the
# quant_linear format each is kept in: Q4_K's sub-blocks become Q4_1 blocks with the
# same codes (`q4_k_to_q4_1_blocks`: its scales rounded to float16). Q6_K and the
# other K-quants are dequantized: their 16-weight sub-blocks with int8 scales have no
# 32-weight block format of ours to go to without requantizing.
PACKED_TYPES = {"Q4_0": "q4_0", "Q4_1": "q4_1", "Q8_0": "q8_0", "Q4_K": "q4_1"}


def gguf_packed_formats(path_or_reader: str | Any) -> dict[str, str | None]:
    """Hugging Face tensor name -> the quant_linear format it can stay in ("q4_0",
    "q4_1", "q8_0"; Q4_K tensors "q4_1"), or None for a tensor that must be dequantized
    (F32, F16, the other K-quants and the other types)."""
    reader = open_gguf(path_or_reader) if isinstance(path_or_reader, str) else path_or_reader
    formats: dict[str, str | None] = {}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        if name is not None:
            formats[name] = PACKED_TYPES.get(tensor.tensor_type.name)
    return formats


def iter_gguf_tensors(path_or_reader: str | Any, keep_packed: frozenset[str] = frozenset()
                      ) -> Iterator[tuple[str, Any]]:
    """(Hugging Face name, tensor in HF shape) for every weight of a GGUF file: float32
    tensors, or for the names in `keep_packed` (of a type in PACKED_TYPES) a
    `PackedTensor` in the file's own format.

    One tensor is converted at a time. Raises ValueError for a tensor with no
    Hugging Face counterpart (the file is not a plain Llama/Qwen checkpoint), or a
    `keep_packed` tensor whose type cannot stay packed (or a Q4_K one whose scales
    overflow float16).
    """
    from gguf.quants import dequantize

    from flowengine.model.layers.quant_linear import pack_gguf_blocks, q4_k_to_q4_1_blocks

    reader = open_gguf(path_or_reader) if isinstance(path_or_reader, str) else path_or_reader
    arch, _, permuted = gguf_architecture(reader)
    num_heads = int(_field(reader, f"{arch}.attention.head_count"))
    num_kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", num_heads))
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":
            continue  # folded into the config's rope_scaling by gguf_hf_config
        name = hf_tensor_name(tensor.name)
        if name is None:
            raise ValueError(f"GGUF tensor {tensor.name!r} has no Hugging Face counterpart")
        if name in keep_packed:
            fmt = PACKED_TYPES.get(tensor.tensor_type.name)
            if fmt is None:
                raise ValueError(f"GGUF tensor {tensor.name!r} of type "
                                 f"{tensor.tensor_type.name} cannot stay quantized")
            raw = np.asarray(tensor.data)
            if permuted and ".self_attn.q_proj." in name:
                raw = unpermute_qk(raw, num_heads)
            elif permuted and ".self_attn.k_proj." in name:
                raw = unpermute_qk(raw, num_kv_heads)
            if tensor.tensor_type.name == "Q4_K":
                raw = q4_k_to_q4_1_blocks(raw)
                if raw is None:
                    raise ValueError(f"GGUF tensor {tensor.name!r}: a Q4_K scale times its "
                                     f"sub-block scale overflows float16: it cannot stay "
                                     f"quantized as Q4_1 blocks")
            yield name, pack_gguf_blocks(raw, fmt, int(tensor.shape[0]))
            continue
        values = dequantize(tensor.data, tensor.tensor_type)
        values = np.asarray(values, dtype=np.float32).reshape(
            tuple(int(d) for d in reversed(tensor.shape))
        )
        if permuted and ".self_attn.q_proj." in name:
            values = unpermute_qk(values, num_heads)
        elif permuted and ".self_attn.k_proj." in name:
            values = unpermute_qk(values, num_kv_heads)
        # Copy: F32 tensors are read-only views of the memory map.
        yield name, torch.from_numpy(np.array(values, dtype=np.float32, copy=True))


def _rope_scaling(reader: Any, arch: str, tensors: dict[str, Any], head_dim: int,
                  rope_theta: float) -> dict[str, Any] | None:
    kind = _field(reader, f"{arch}.rope.scaling.type", None)
    if "rope_freqs.weight" in tensors:
        from gguf.quants import dequantize

        t = tensors["rope_freqs.weight"]
        factors = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float64).reshape(-1)
        return _llama3_from_factors(factors, head_dim, rope_theta)
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(_field(reader, f"{arch}.rope.scaling.factor"))}
    raise ValueError(f"GGUF RoPE scaling type {kind!r} is not supported (only linear and llama3)")


def _llama3_from_factors(factors: np.ndarray, head_dim: int, rope_theta: float
                         ) -> dict[str, Any]:
    """Recover llama3 rope_scaling from llama.cpp's per-frequency divisors.

    llama.cpp (`LlamaModel.generate_extra_tensors`) writes, per frequency, 1 (short
    wavelengths), `factor` (long ones) or 1 / ((1 - smooth) / factor + smooth).
    """
    factor = float(factors.max())
    freqs = 1.0 / (rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * math.pi / freqs
    for low, high, old_len in _LLAMA3_ROPE_CANDIDATES:
        smooth = (old_len / wavelen - low) / (high - low)
        expected = np.where(
            wavelen < old_len / high, 1.0,
            np.where(wavelen > old_len / low, factor, 1 / ((1 - smooth) / factor + smooth)),
        )
        if np.allclose(expected, factors, rtol=1e-4, atol=1e-4):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                    "high_freq_factor": high, "original_max_position_embeddings": old_len}
    raise ValueError(
        "the GGUF file's rope_freqs tensor matches no known Llama 3 RoPE scaling; "
        "pass the Hugging Face checkpoint instead"
    )


def _as_decimal(value: float) -> float:
    """The shortest decimal that rounds to the same float32 (1e-05, not
    9.999999747378752e-06): GGUF stores float32, Hugging Face configs decimals."""
    return float(str(np.float32(value)))


_REQUIRED = object()


def _field(reader: Any, key: str, default: Any = _REQUIRED) -> Any:
    """A metadata value; `default` when absent, ValueError when absent and required."""
    field = reader.fields.get(key)
    if field is None:
        if default is _REQUIRED:
            raise ValueError(f"GGUF metadata key {key!r} is missing; the file is incomplete")
        return default
    return field.contents()
