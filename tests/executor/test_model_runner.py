"""ModelRunner state handling: the StepPlan protocol, prefix reuse, KV cache sizing."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from flowengine.config import CacheConfig
from flowengine.executor.model_runner import ModelRunner
from flowengine.messages import CachedRequestData, NewRequestData, StepPlan
from flowengine.model.model_config import ModelConfig
from flowengine.sampling_params import SamplingParams

BLOCK = 4


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> ModelRunner:
    path = str(tmp_path_factory.mktemp("tiny"))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      initializer_range=0.2)
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return ModelRunner(ModelConfig.from_pretrained(path), CacheConfig(BLOCK, 32),
                       torch.device("cpu"), torch.float32)


def _new(req_id: str, tokens: list[int], blocks: list[int], computed: int = 0) -> NewRequestData:
    return NewRequestData(req_id, tokens, len(tokens), SamplingParams(), blocks, computed, 7)


def test_kv_cache_geometry() -> None:
    config = ModelConfig("/m", "LlamaForCausalLM", 49152, 576, 30, 9, 3, 64, 1536, 1e-5, 1e5,
                         None, 8192, 8192, True, False, False, False, False, (2,), 1,
                         torch.float32)
    # 2 (K, V) x 30 layers x 16 slots x 3 KV heads x 64 dims x 4 bytes
    assert ModelRunner.kv_cache_bytes_per_block(config, 16, torch.float32) == 737280
    assert ModelRunner.kv_cache_bytes_per_block(config, 16, torch.bfloat16) == 368640


def test_cached_prefix_gives_the_same_logits(runner: ModelRunner) -> None:
    prompt = [(7 * i + 3) % 128 for i in range(18)]
    assert len(runner.kv_caches) == 2
    assert runner.kv_caches[0].shape == (2, 32, BLOCK, 2, 8)
    # "a" prefills in two chunks: 10 tokens (no sample), then 8.
    out = runner.execute_model(StepPlan(0, [_new("a", prompt, [9, 4, 30])], [], [10]))
    assert out.req_ids == [] and out.logits.shape == (0, 128)
    out = runner.execute_model(StepPlan(1, [], [CachedRequestData("a", [12, 0], 10)], [8]))
    assert out.req_ids == ["a"]
    full = out.logits[0]
    state = runner.get_request_state("a")
    assert state.num_computed_tokens == 18 and state.block_ids == [9, 4, 30, 12, 0]
    assert state.eos_token_id == 7 and state.output_token_ids == []

    # "b" has the same prompt and reuses a's four full blocks (16 tokens) as a prefix
    # cache hit, computing only the last 2 tokens into a block of its own.
    out = runner.execute_model(StepPlan(2, [_new("b", prompt, [9, 4, 30, 12, 17], 16)], [], [2]))
    assert out.req_ids == ["b"]
    torch.testing.assert_close(out.logits[0], full, atol=1e-5, rtol=0)

    runner.append_sampled("b", [int(full.argmax())])
    assert runner.get_request_state("b").output_token_ids == [int(full.argmax())]
    runner.execute_model(StepPlan(3, [], [], [], ["a", "b"]))
    assert runner.requests == {}


def test_plan_errors(runner: ModelRunner) -> None:
    with pytest.raises(ValueError, match="continues request ghost that this executor does not hold"):
        runner.execute_model(StepPlan(0, [], [CachedRequestData("ghost", [], 3)], [1]))
    with pytest.raises(ValueError, match="has 2 num_scheduled_tokens for 1 scheduled requests"):
        runner.execute_model(StepPlan(1, [_new("x", [1, 2], [3])], [], [1, 1]))
    runner.execute_model(StepPlan(2, [], [], [], ["x"]))
    with pytest.raises(KeyError):
        runner.get_request_state("x")
