"""`LLM.encode` (vLLM's generic pooling entry): the pooled tensor of each prompt equals
`LLM.embed`'s vector exactly; `pooling_task` is required and checked against the model
before anything runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flowengine import LLM
from flowengine.pooling import PoolingOutput, PoolingParams, PoolingRequestOutput
from flowengine.pooling.params import check_pooling_task, supported_tasks

PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def tiny_path(default_model_path, tmp_path_factory) -> str:
    """A random 2-layer Llama with the default model's tokenizer (fast to load; the
    pooled values are checked against LLM.embed, not against a reference model)."""
    import shutil
    from pathlib import Path

    from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-embed")
    vocab = AutoConfig.from_pretrained(default_model_path).vocab_size
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    for f in Path(default_model_path).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, path / f.name)
    return str(path)


def test_pooling_task_check():
    assert check_pooling_task("embed", "pooling") == "embed"
    assert supported_tasks("pooling") == ("embed",) and supported_tasks("generate") == ("generate",)
    with pytest.raises(ValueError, match="pooling_task is required.*LLM.embed"):
        check_pooling_task(None, "pooling")
    with pytest.raises(ValueError, match="needs a pooling model.*runner='pooling'"):
        check_pooling_task("embed", "generate")
    with pytest.raises(ValueError, match=r"'classify' is not supported by this model; it "
                                         r"supports \['embed'\]"):  # fmt: skip
        check_pooling_task("classify", "pooling")
    with pytest.raises(ValueError, match="not a vLLM pooling task"):
        check_pooling_task("embedding", "pooling")


def test_encode_returns_the_embeddings_as_tensors(tiny_path):
    llm = LLM(tiny_path, runner="pooling", max_model_len=256, num_kv_blocks=64)
    embedded = llm.embed(PROMPTS, use_tqdm=False)
    encoded = llm.encode(PROMPTS, pooling_task="embed", use_tqdm=False)
    assert [type(o) for o in encoded] == [PoolingRequestOutput] * len(PROMPTS)
    for e, o, prompt in zip(embedded, encoded, PROMPTS, strict=True):
        assert isinstance(o.outputs, PoolingOutput) and o.error is None and o.finished
        assert o.outputs.data.dtype == torch.float32
        assert o.outputs.data.shape == (e.outputs.hidden_size,)
        np.testing.assert_array_equal(o.outputs.data.numpy(), e.outputs.vector)
        assert o.prompt == prompt and o.prompt_token_ids == e.prompt_token_ids
    raw = llm.encode(PROMPTS[0], PoolingParams(normalize=False), pooling_task="embed",
                     use_tqdm=False)  # fmt: skip
    norm = float(torch.linalg.vector_norm(raw[0].outputs.data))
    assert abs(norm - 1.0) > 1e-3  # not normalised, as asked
    np.testing.assert_allclose(
        (raw[0].outputs.data / norm).numpy(), encoded[0].outputs.data.numpy(), rtol=1e-5,
        atol=1e-6,
    )  # fmt: skip
    for task, words in ((None, "required"), ("classify", "not supported")):
        with pytest.raises(ValueError, match=words):
            llm.encode(PROMPTS, pooling_task=task, use_tqdm=False)
    # A dict is neither a PoolingParams nor a list of them (it would iterate its keys).
    with pytest.raises(TypeError, match="pooling_params must be a PoolingParams or a list "
                                        "of them .one per prompt., not dict"):
        llm.embed(PROMPTS, {"normalize": False}, use_tqdm=False)


def test_truncate_prompt_tokens_applies_with_pooling_params_too(tiny_path):
    """`truncate_prompt_tokens=` truncates every prompt whether or not PoolingParams are
    given (vLLM's LLM.encode merges it into each request's tokenization); it used to be
    dropped silently when they were, so a long input failed or was embedded whole."""
    llm = LLM(tiny_path, runner="pooling", max_model_len=256, num_kv_blocks=64)
    raw = PoolingParams(normalize=False)
    whole = llm.embed(PROMPTS, raw, use_tqdm=False)
    for params in (raw, [raw, PoolingParams(normalize=False, truncate_prompt_tokens=3)]):
        cut = llm.embed(PROMPTS, params, truncate_prompt_tokens=2, use_tqdm=False)
        for c, w in zip(cut, whole, strict=True):
            assert c.prompt_token_ids == w.prompt_token_ids[-2:]
            last_two = llm.embed([w.prompt_token_ids[-2:]], raw, use_tqdm=False)[0]
            np.testing.assert_allclose(c.outputs.vector, last_two.outputs.vector, rtol=1e-5,
                                       atol=1e-6)
    encoded = llm.encode(PROMPTS, raw, pooling_task="embed", truncate_prompt_tokens=2,
                         use_tqdm=False)  # fmt: skip
    assert [o.prompt_token_ids for o in encoded] == [w.prompt_token_ids[-2:] for w in whole]
