"""Fixtures shared by the tensor- and pipeline-parallel engine tests."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, default_model_path: str) -> str:
    """A random-weight Llama (float32, transformers' initialization) whose head counts
    divide by 4, with 4 layers (2 per stage at PP = 2) and the default model's
    tokenizer."""
    path = str(tmp_path_factory.mktemp("tiny-llama"))
    cfg = LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                      max_position_embeddings=512, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(default_model_path, name), path)
    return path
