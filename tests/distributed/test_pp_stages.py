"""Pipeline stages without processes: vLLM's even layer split, the errors for
combinations that cannot work, and stage runners joined by an in-memory pipe whose
last stage gives the same logits as the whole model, with only its own layers'
weights and KV cache."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from flowengine.config import CacheConfig, EngineArgs
from flowengine.distributed.pp_group import (
    PP_LAYER_PARTITION_ENV,
    PipelineStage,
    check_pipeline_parallel,
    partition_layers,
)
from flowengine.executor.model_runner import ModelRunner
from flowengine.messages import CachedRequestData, NewRequestData, StepPlan
from flowengine.model.model_config import ModelConfig
from flowengine.sampling_params import SamplingParams


def test_even_split_gives_the_remainder_to_the_stages_before_the_last() -> None:
    assert partition_layers(30, 2) == [(0, 15), (15, 30)]  # SmolLM2-135M
    assert partition_layers(30, 4) == [(0, 7), (7, 15), (15, 23), (23, 30)]
    assert partition_layers(3, 2) == [(0, 2), (2, 3)]
    assert partition_layers(31, 4) == [(0, 8), (8, 16), (16, 24), (24, 31)]
    assert partition_layers(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert partition_layers(5, 1) == [(0, 5)]
    assert partition_layers(30, 2, "20,10") == [(0, 20), (20, 30)]


def test_bad_partitions_are_clear_errors(monkeypatch) -> None:
    with pytest.raises(ValueError, match="pipeline_parallel_size 5 exceeds the model's 4 "
                                         "decoder layers.*at most 4"):
        partition_layers(4, 5)
    for spec in ("10,10", "30", "31,-1", "a,b"):
        with pytest.raises(ValueError, match=PP_LAYER_PARTITION_ENV):
            partition_layers(30, 2, spec)
    monkeypatch.setenv(PP_LAYER_PARTITION_ENV, "1,2")
    with pytest.raises(ValueError, match="expected 2 positive layer counts summing to "
                                         "num_hidden_layers 30"):
        check_pipeline_parallel(30, 2)


def test_engine_args_for_pipeline_parallelism() -> None:
    args = EngineArgs(pipeline_parallel_size=2)
    assert args.placement == "multiproc"
    with pytest.raises(ValueError, match="pipeline_parallel_size 2 keeps 2 steps in flight.*"
                                         "turn async_scheduling off"):
        EngineArgs(pipeline_parallel_size=2, async_scheduling=True)
    with pytest.raises(ValueError, match="speculative_config needs pipeline_parallel_size 1"):
        EngineArgs(pipeline_parallel_size=2,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_more_stages_than_layers_fails_at_resolve(default_model_path: str) -> None:
    from flowengine.engine.builder import resolve

    with pytest.raises(ValueError, match="pipeline_parallel_size 31 exceeds the model's 30"):
        resolve(EngineArgs(model=default_model_path, pipeline_parallel_size=31, device="cpu"))


def test_a_family_without_a_llama_decoder_is_refused(tmp_path) -> None:
    from transformers import Gemma2Config

    from flowengine.engine.builder import _check_stages_supported

    Gemma2Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                 architectures=["Gemma2ForCausalLM"]).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="pipeline parallelism is not supported for "
                                         "Gemma2ForCausalLM models"):
        _check_stages_supported(ModelConfig.from_pretrained(str(tmp_path), 64))


@dataclass(frozen=True)
class PipedStage(PipelineStage):
    """A stage whose send/recv go through an in-memory pipe (no torch.distributed)."""

    pipe: deque = field(default_factory=deque, compare=False)

    def send_next(self, tensor: torch.Tensor) -> None:
        self.pipe.append(tensor.clone())

    def recv_prev(self, shape, dtype, device) -> torch.Tensor:
        tensor = self.pipe.popleft()
        assert tensor.shape == shape and tensor.dtype == dtype
        return tensor


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny-llama-pp"))
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path


def _runner(config: ModelConfig, pp: PipelineStage | None = None) -> ModelRunner:
    kwargs = {} if pp is None else {"pp": pp}
    return ModelRunner(config, CacheConfig(16, 8), torch.device("cpu"), torch.float32,
                       "safetensors", **kwargs)


@pytest.mark.parametrize("num_stages", [2, 3])
def test_stage_runners_equal_the_whole_model(tiny_llama: str, num_stages: int) -> None:
    config = ModelConfig.from_pretrained(tiny_llama, 256)
    whole = _runner(config)
    pipe: deque = deque()
    bounds = partition_layers(3, num_stages)
    stages = [_runner(config, PipedStage(i, num_stages, start, end, pipe=pipe))
              for i, (start, end) in enumerate(bounds)]
    # Each stage holds only its part: layers, KV cache, embedding / norm and LM head.
    for i, (stage, (start, end)) in enumerate(zip(stages, bounds, strict=True)):
        names = {n for n, _ in stage.model.named_parameters()}
        assert {int(n.split(".")[2]) for n in names if n.startswith("model.layers.")} \
            == set(range(start, end))
        assert ("model.embed_tokens.weight" in names) == (i == 0)
        assert ("model.norm.weight" in names) == ("lm_head.weight" in names) \
            == (i == num_stages - 1)
        assert len(stage.kv_caches) == end - start
    assert len(whole.kv_caches) == 3
    torch.testing.assert_close(stages[-1].model.lm_head.weight, whole.model.lm_head.weight,
                               rtol=0, atol=0)

    greedy = SamplingParams(temperature=0, max_tokens=8)
    prompts = {"a": [5, 17, 300, 42, 7, 9, 100, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13],
               "b": [400, 401, 3]}
    blocks = {"a": [0, 1], "b": [2]}
    # Step 1: "a" gets a first chunk of 10 tokens, "b" its whole prompt. The first
    # stages learn the sampled tokens from the next plan's new_token_ids only.
    plans = [StepPlan(1, [NewRequestData(r, p, len(p), greedy, blocks[r], 0)
                          for r, p in prompts.items()], [], [10, 3])]
    outputs = []
    for step in range(2, 6):
        plan = plans[-1]
        out_whole = whole.execute_model(plan)
        for stage in stages[:-1]:
            assert stage.execute_model(plan).logits is None
            assert len(pipe) == 1  # its hidden states, sent on to the next stage
        out_last = stages[-1].execute_model(plan)
        assert not pipe
        assert out_last.req_ids == out_whole.req_ids
        torch.testing.assert_close(out_last.logits, out_whole.logits, rtol=0, atol=0)
        tokens = out_whole.logits.argmax(-1).tolist()
        outputs.append(dict(zip(out_whole.req_ids, tokens, strict=True)))
        # The runners that sample (whole, last stage) append.
        for rid, tok in outputs[-1].items():
            whole.append_sampled(rid, [tok])
            stages[-1].append_sampled(rid, [tok])
        cached = []
        for rid, state in whole.requests.items():
            done = state.num_computed_tokens
            new = state.token_ids[max(done, state.num_prompt_tokens):]
            cached.append(CachedRequestData(rid, [], done, new_token_ids=new))
        plans.append(StepPlan(step, [], cached, [
            min(len(whole.requests[c.req_id].token_ids) - c.num_computed_tokens, 16)
            for c in cached]))
    assert [sorted(o) for o in outputs] == [["b"], ["a", "b"], ["a", "b"], ["a", "b"]]
    # Every token but the last sampled one, which only the next plan would carry.
    for rid in prompts:
        for stage in stages[:-1]:
            assert stage.requests[rid].token_ids == whole.requests[rid].token_ids[:-1]
        assert stages[-1].requests[rid].token_ids == whole.requests[rid].token_ids
