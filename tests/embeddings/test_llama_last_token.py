"""Last-token pooling over the Llama family (decoder embedding models, vLLM's
`--runner pooling`): the default model's final-norm hidden state of each prompt's last
token, L2-normalised, equals transformers' LlamaModel output; mean pooling by
--pooler-config; the generate runner of the same weights refuses embeddings."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flowengine import LLM
from flowengine.pooling import PoolingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "A much longer prompt that spans several KV blocks of sixteen tokens each, so "
           "that the request's block table has more than one entry in its first step."]


@pytest.fixture(scope="module")
def hf_states(default_model_path, tokenizer):
    from transformers import AutoModel

    model = AutoModel.from_pretrained(default_model_path, dtype=torch.float32).eval()
    states = []
    with torch.inference_mode():
        for p in PROMPTS:
            ids = torch.tensor([tokenizer.encode(p)])
            states.append(model(ids).last_hidden_state[0].numpy())
    return states


def _unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v)


def test_last_token_pooling_equals_transformers(default_model_path, hf_states):
    llm = LLM(default_model_path, runner="pooling", max_model_len=256, num_kv_blocks=64)
    assert llm.resolved.pooler_config.pooling_type == "LAST"
    outs = llm.embed(PROMPTS, use_tqdm=False)
    for out, ref in zip(outs, hf_states, strict=True):
        np.testing.assert_allclose(out.outputs.embedding, _unit(ref[-1]), atol=2e-5)
    raw = llm.embed(PROMPTS[0], PoolingParams(normalize=False), use_tqdm=False)[0]
    np.testing.assert_allclose(raw.outputs.embedding, hf_states[0][-1], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="embeddings only"):
        llm.generate(PROMPTS[0], use_tqdm=False)
    assert llm.engine.scheduler.num_free_blocks == llm.engine.scheduler.num_total_blocks


def test_mean_pooling_from_pooler_config(default_model_path, hf_states):
    llm = LLM(default_model_path, runner="pooling", max_model_len=256, num_kv_blocks=64,
              pooler_config={"pooling_type": "MEAN", "normalize": False})
    outs = llm.embed(PROMPTS, use_tqdm=False)
    for out, ref in zip(outs, hf_states, strict=True):
        np.testing.assert_allclose(out.outputs.embedding, ref.mean(0), rtol=1e-4, atol=1e-4)


def test_generate_runner_refuses_embeddings(default_model_path):
    llm = LLM(default_model_path, max_model_len=256, num_kv_blocks=64)
    assert llm.resolved.runner == "generate"
    with pytest.raises(ValueError, match="serves generation, not embeddings"):
        llm.embed("hello", use_tqdm=False)
    with pytest.raises(ValueError, match="pooler_config applies to the pooling runner"):
        LLM(default_model_path, pooler_config={"pooling_type": "MEAN"})
