"""ModelRunner greedy outputs against Hugging Face transformers, one tiny model per family.

Each case saves a random transformers model (safetensors) and compares greedy token
ids exactly, and every step's logits to atol 1e-4, with `generate(do_sample=False)`
in float32. The runs use chunked prefill, non-contiguous blocks and a preemption.
"""

from __future__ import annotations

import pytest
import torch
from runner_driver import GreedyDriver
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from flowengine.config import CacheConfig
from flowengine.executor.model_runner import ModelRunner
from flowengine.model.model_config import ModelConfig

_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_attention_heads=4,
               max_position_embeddings=256, eos_token_id=None, bos_token_id=None,
               pad_token_id=None)

FAMILIES = {
    # Llama 3.1-style RoPE scaling; original context 32 puts frequencies in all three
    # bands of the rule (kept, interpolated, divided by factor).
    "llama3-rope-scaling": LlamaConfig(
        **_COMMON, num_hidden_layers=3, num_key_value_heads=2, rope_theta=10000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    # SmolLM2-style: tied embeddings; plus every optional Llama bias.
    "llama-tied-bias": LlamaConfig(
        **_COMMON, num_hidden_layers=2, num_key_value_heads=1, tie_word_embeddings=True,
        attention_bias=True, mlp_bias=True),
    "mistral": MistralConfig(**_COMMON, num_hidden_layers=2, num_key_value_heads=2,
                             sliding_window=None),
    "qwen2-qkv-bias": Qwen2Config(**_COMMON, num_hidden_layers=2, num_key_value_heads=2),
    "qwen3-qk-norm": Qwen3Config(**_COMMON, num_hidden_layers=4, num_key_value_heads=1,
                                 head_dim=32),
}

PROMPTS = {"short": [5, 17, 3], "medium": list(range(40, 70)), "one": [9]}
NUM_NEW = 12


def _save_random_model(hf_config: object, path: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    # Weights larger than the default init spread the logits apart (no near-ties for
    # argmax) and make biases and norm weights non-trivial.
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn_like(param) * 0.1
            param.copy_(1.0 + noise if "norm" in name else noise * 2)
    model.save_pretrained(path, safe_serialization=True)
    return model.eval()


def _hf_greedy(model: torch.nn.Module, prompt: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    # The configs have no EOS, so generate() runs all NUM_NEW steps.
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NUM_NEW,
                         output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[0, len(prompt):].tolist(), [x[0] for x in out.logits]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_matches_transformers(family: str, tmp_path: object) -> None:
    hf_model = _save_random_model(FAMILIES[family], str(tmp_path))
    config = ModelConfig.from_pretrained(str(tmp_path))
    runner = ModelRunner(config, CacheConfig(block_size=8, num_blocks=64),
                         torch.device("cpu"), torch.float32)
    # Budget 16: the 30-token prompt is prefilled in two chunks, the third partly
    # batched with decodes. "short" is preempted once and recomputed.
    driver = GreedyDriver(runner, token_budget=16, seed=1, preempt={"short": 5})
    seqs = driver.generate(PROMPTS, NUM_NEW)
    assert driver.partial_chunks > 0 and driver.num_preemptions == 1
    assert runner.requests == {}  # finished requests were dropped
    for rid, prompt in PROMPTS.items():
        expected_ids, expected_logits = _hf_greedy(hf_model, prompt)
        assert seqs[rid].outputs == expected_ids, rid
        for ours, theirs in zip(seqs[rid].logits, expected_logits, strict=True):
            torch.testing.assert_close(ours, theirs.float(), atol=1e-4, rtol=0)
