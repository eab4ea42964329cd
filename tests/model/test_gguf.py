"""GGUF reading and conversion: permutation, dequantization, config, cache directory."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from tiny_gguf import VOCAB_SIZE, llama_cpp_permute, write_tiny_llama_gguf
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from flowengine.config import CacheConfig
from flowengine.executor.model_runner import ModelRunner
from flowengine.messages import NewRequestData, StepPlan
from flowengine.model import gguf_convert
from flowengine.model.gguf_loader import hf_tensor_name, unpermute_qk
from flowengine.model.model_config import ModelConfig, RopeScaling
from flowengine.model.resolve import resolve_model
from flowengine.sampling_params import SamplingParams


@pytest.mark.parametrize("num_heads,head_dim,cols", [(9, 64, 5), (3, 64, 1), (4, 8, 7)])
def test_unpermute_inverts_llama_cpp_permute(num_heads: int, head_dim: int, cols: int) -> None:
    weight = np.random.default_rng().standard_normal((num_heads * head_dim, cols))
    weight = weight.astype(np.float32)
    permuted = llama_cpp_permute(weight, num_heads)
    assert not np.array_equal(permuted, weight)
    np.testing.assert_array_equal(unpermute_qk(permuted, num_heads), weight)
    bias = weight[:, 0].copy()  # 1-D tensors (q/k biases) are permuted the same way
    np.testing.assert_array_equal(unpermute_qk(llama_cpp_permute(bias, num_heads), num_heads), bias)


def test_tensor_names_map_to_hugging_face() -> None:
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("output_norm.weight") == "model.norm.weight"
    assert hf_tensor_name("blk.12.attn_q.bias") == "model.layers.12.self_attn.q_proj.bias"
    assert hf_tensor_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_tensor_name("blk.3.attn_k_norm.weight") == "model.layers.3.self_attn.k_norm.weight"
    assert hf_tensor_name("blk.0.ffn_gate_exps.weight") is None


def _tiny_llama() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384,
        rope_theta=10000.0, bos_token_id=257, eos_token_id=258,
        # Meta's Llama 3.1 constants; with head_dim 16 and theta 1e4 the 8 frequencies
        # fall in all three bands of the rule.
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn_like(param) * 0.1
            param.copy_(1.0 + noise if "norm" in name else noise * 2)
    return model


def _last_token_logits(runner: ModelRunner, prompts: list[list[int]]) -> torch.Tensor:
    new, blocks = [], iter(range(runner.cache_config.num_blocks - 1, -1, -1))
    for i, prompt in enumerate(prompts):
        ids = [next(blocks) for _ in range(-(-len(prompt) // runner.cache_config.block_size))]
        new.append(NewRequestData(f"r{i}", prompt, len(prompt), SamplingParams(), ids, 0))
    out = runner.execute_model(StepPlan(0, new, [], [len(p) for p in prompts]))
    assert out.req_ids == [f"r{i}" for i in range(len(prompts))]
    return out.logits


def test_tiny_gguf_converts_once_and_matches_transformers(tmp_path: object,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    hf_model = _tiny_llama()
    gguf_path = os.path.join(str(tmp_path), "tiny.gguf")
    write_tiny_llama_gguf(hf_model, gguf_path)  # hf_model now holds the dequantized values
    monkeypatch.setenv("FLOWENGINE_CACHE", os.path.join(str(tmp_path), "cache"))

    resolved = resolve_model(gguf_path)
    assert resolved.gguf_file == gguf_path and resolved.name == "tiny.gguf"
    assert os.path.dirname(resolved.path) == os.path.join(str(tmp_path), "cache", "models")
    config = ModelConfig.from_pretrained(resolved.path)
    assert config.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert (config.num_heads, config.num_kv_heads, config.tie_word_embeddings) == (4, 2, False)
    assert config.eos_token_ids == (258,) and config.bos_token_id == 257
    tokenizer = AutoTokenizer.from_pretrained(resolved.path)
    assert tokenizer("hello").input_ids == [256, 75, 75, 78]  # "he" merged, then bytes

    prompts = [[5, 17, 3, 250, 256], list(range(40, 75)), [9]]
    with torch.no_grad():
        expected = torch.stack([hf_model(torch.tensor([p])).logits[0, -1] for p in prompts])
    cache = CacheConfig(block_size=8, num_blocks=16)
    from_dir = ModelRunner(config, cache, torch.device("cpu"), torch.float32)
    torch.testing.assert_close(_last_token_logits(from_dir, prompts), expected, atol=1e-4, rtol=0)
    # load_format "gguf": the same tensors straight from the file, named or found through
    # the converted directory's record of its source.
    for model_path in (gguf_path, None):
        from_file = ModelRunner(config, cache, torch.device("cpu"), torch.float32, "gguf",
                                model_path)
        torch.testing.assert_close(_last_token_logits(from_file, prompts), expected,
                                   atol=1e-4, rtol=0)

    marker = os.path.join(resolved.path, gguf_convert.MARKER_FILE)
    mtime = os.stat(marker).st_mtime_ns
    assert resolve_model(gguf_path) == resolved
    assert os.stat(marker).st_mtime_ns == mtime  # converted once, then reused


def test_crash_during_conversion_leaves_no_directory(tmp_path: object,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    gguf_path = os.path.join(str(tmp_path), "tiny.gguf")
    write_tiny_llama_gguf(_tiny_llama(), gguf_path)
    out_dir = os.path.join(str(tmp_path), "models", "tiny")

    def crash(src: str, dst: str) -> None:
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump({"partial": True}, f)
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_convert, "_write_hf_dir", crash)
    with pytest.raises(KeyboardInterrupt):
        gguf_convert.convert_gguf_to_hf(gguf_path, out_dir)
    assert os.listdir(os.path.dirname(out_dir)) == []
    assert not gguf_convert.is_converted(out_dir)
