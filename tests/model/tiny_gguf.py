"""Write a tiny Llama GGUF file the way llama.cpp's convert_hf_to_gguf.py does.

Used to test the GGUF reader without the 100 MB default model: q/k rows permuted
with llama.cpp's `LlamaModel.permute`, Llama 3 RoPE scaling stored as a `rope_freqs`
tensor (`LlamaModel.generate_extra_tensors`), a byte-level BPE vocabulary, and a mix
of Q8_0, F16 and F32 tensors. The Hugging Face model it came from is updated to the
quantize-dequantize round trip of its weights, so both hold identical values.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize
from tokenizers.pre_tokenizers import ByteLevel

_LAYER_TENSORS = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
# 256 byte tokens + one merge + BOS/EOS.
VOCAB_SIZE = 259


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py `LlamaModel.permute` (rotate-half rows -> interleaved)."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def llama3_rope_factors(config: object) -> np.ndarray:
    """convert_hf_to_gguf.py's per-frequency divisors for rope_type llama3."""
    rope = config.rope_parameters
    dim = config.head_dim
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            factors.append(1.0)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def llama_gguf_writer(path: str, cfg: object) -> GGUFWriter:
    """A GGUFWriter for `path` holding a Llama config's metadata (as llama.cpp's
    converter writes it) and the byte-level vocabulary of VOCAB_SIZE tokens; the caller
    adds the tensors and writes the file."""
    writer = GGUFWriter(path, "llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_vocab_size(cfg.vocab_size)
    tokens = sorted(ByteLevel.alphabet()) + ["he", "<s>", "</s>"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 257 + [3, 3])
    writer.add_token_merges(["h e"])
    writer.add_bos_token_id(257)
    writer.add_eos_token_id(258)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    return writer


def write_tiny_llama_gguf(model: torch.nn.Module, path: str) -> None:
    """Write `model` (a transformers LlamaForCausalLM, vocab VOCAB_SIZE, untied) to `path`.

    token_embd is stored as Q8_0 and output as F16; `model`'s copies of those weights
    are replaced by their dequantized values.
    """
    cfg = model.config
    writer = llama_gguf_writer(path, cfg)

    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    with torch.no_grad():
        q8 = quantize(state["model.embed_tokens.weight"], GGMLQuantizationType.Q8_0)
        writer.add_tensor("token_embd.weight", q8, raw_dtype=GGMLQuantizationType.Q8_0)
        model.model.embed_tokens.weight.copy_(
            torch.from_numpy(dequantize(q8, GGMLQuantizationType.Q8_0)))
        f16 = state["lm_head.weight"].astype(np.float16)
        writer.add_tensor("output.weight", f16)
        model.lm_head.weight.copy_(torch.from_numpy(f16.astype(np.float32)))
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    if cfg.rope_parameters.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(cfg))
    for i in range(cfg.num_hidden_layers):
        for hf, gg in _LAYER_TENSORS.items():
            w = state[f"model.layers.{i}.{hf}.weight"]
            if gg == "attn_q":
                w = llama_cpp_permute(w, cfg.num_attention_heads)
            elif gg == "attn_k":
                w = llama_cpp_permute(w, cfg.num_key_value_heads)
            writer.add_tensor(f"blk.{i}.{gg}.weight", np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
