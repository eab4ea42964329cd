"""ModelConfig resolution from Hugging Face configs (transformers 4.x and 5.x dialects)."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, PretrainedConfig, Qwen2Config, Qwen3Config

from flowengine.model.model_config import (
    ModelConfig,
    RopeScaling,
    resolve_dtype,
    resolve_max_model_len,
)


def test_llama3_config_with_generation_eos(tmp_path: object) -> None:
    cfg = LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_theta=500000.0, bos_token_id=128000, eos_token_id=128001,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        dtype="bfloat16", architectures=["LlamaForCausalLM"],
    )
    cfg.save_pretrained(str(tmp_path))
    with open(os.path.join(str(tmp_path), "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [128001, 128008, 128009]}, f)
    mc = ModelConfig.from_pretrained(str(tmp_path), max_model_len=8192)
    assert (mc.architecture, mc.num_layers, mc.num_heads, mc.num_kv_heads, mc.head_dim) == (
        "LlamaForCausalLM", 32, 32, 8, 128)
    assert mc.rope_theta == 500000.0
    assert mc.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert mc.max_position_embeddings == 131072 and mc.max_model_len == 8192
    assert mc.eos_token_ids == (128001, 128008, 128009) and mc.eos_token_id == 128001
    assert mc.bos_token_id == 128000 and mc.dtype == torch.bfloat16
    assert (mc.qkv_bias, mc.o_bias, mc.mlp_bias, mc.qk_norm, mc.tie_word_embeddings) == (
        False, False, False, False, False)


def test_transformers_4_dialect_rope_fields() -> None:
    """4.x configs keep rope_theta apart and call the scaling dict rope_scaling/type.

    A namespace stands in for a 4.x config object (transformers 5 rewrites the fields).
    """
    cfg = SimpleNamespace(
        architectures=["LlamaForCausalLM"], vocab_size=100, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=512, rms_norm_eps=1e-6, torch_dtype="float16",
        rope_theta=1234.0, rope_scaling={"type": "linear", "factor": 2.0},
    )
    mc = ModelConfig.from_hf_config(cfg, "/x")
    assert mc.rope_theta == 1234.0 and mc.rope_scaling == RopeScaling("linear", 2.0)
    assert mc.num_kv_heads == 4 and mc.head_dim == 16 and mc.dtype == torch.float16


def test_family_switches() -> None:
    qwen2 = ModelConfig.from_hf_config(Qwen2Config(architectures=["Qwen2ForCausalLM"]), "/q")
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.qk_norm) == (True, False, False)
    qwen3 = ModelConfig.from_hf_config(
        Qwen3Config(architectures=["Qwen3ForCausalLM"], head_dim=128, hidden_size=1024,
                    num_attention_heads=16, num_key_value_heads=8), "/q")
    assert (qwen3.qkv_bias, qwen3.qk_norm, qwen3.head_dim) == (False, True, 128)
    # Mistral 7B v0.1 slides a 4096-token window in every layer: applied in attention and
    # the KV cache (tests/core/test_sliding_window.py), so the length is not capped.
    mistral = ModelConfig.from_hf_config(
        MistralConfig(architectures=["MistralForCausalLM"], sliding_window=4096,
                      max_position_embeddings=32768, num_hidden_layers=3), "/m")
    assert (mistral.max_model_len, mistral.sliding_window) == (32768, 4096)
    assert (mistral.sliding_layers, mistral.kv_sliding_window) == ((0, 1, 2), 4096)
    no_window = ModelConfig.from_hf_config(
        MistralConfig(architectures=["MistralForCausalLM"], sliding_window=None), "/m")
    assert (no_window.sliding_window, no_window.kv_sliding_window) == (None, None)
    # A window FlowEngine does not apply (Qwen2's use_sliding_window): capped to it.
    qwen2_window = Qwen2Config(architectures=["Qwen2ForCausalLM"], use_sliding_window=True,
                               sliding_window=4096, max_position_embeddings=32768)
    assert ModelConfig.from_hf_config(qwen2_window, "/q").max_model_len == 4096
    with pytest.raises(ValueError, match="max_model_len 8192 exceeds the model's sliding window"):
        ModelConfig.from_hf_config(qwen2_window, "/q", 8192)


def test_unsupported_inputs_raise_clear_errors() -> None:
    gpt2 = PretrainedConfig(architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM, MistralForCausalLM"):
        ModelConfig.from_hf_config(gpt2, "/g")
    # yarn, longrope and dynamic are served now (tests/model/test_rope_variants.py); a
    # type transformers does not know either is refused with the supported list.
    unknown = SimpleNamespace(**LlamaConfig(architectures=["LlamaForCausalLM"]).to_dict())
    unknown.architectures = ["LlamaForCausalLM"]
    unknown.rope_parameters = {"rope_type": "su", "factor": 4.0, "rope_theta": 1e4}
    with pytest.raises(ValueError, match="RoPE scaling type 'su' is not supported; supported: "
                                         "default, linear, dynamic, yarn, longrope, llama3"):
        ModelConfig.from_hf_config(unknown, "/y")
    with pytest.raises(ValueError, match="max_model_len 4096 exceeds the model's "
                                         "max_position_embeddings \\(2048\\); lower"):
        resolve_max_model_len(4096, 2048)
    assert resolve_max_model_len(None, 2048) == 2048
    assert resolve_max_model_len(100, 2048, sliding_window=4096) == 100


def test_resolve_dtype() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("auto", torch.bfloat16, cpu) == torch.float32
    assert resolve_dtype("auto", torch.float16, cuda) == torch.float16
    assert resolve_dtype("auto", torch.float32, cuda) == torch.bfloat16
    assert resolve_dtype("bfloat16", torch.float32, cpu) == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be"):
        resolve_dtype("int8", torch.float32, cpu)
