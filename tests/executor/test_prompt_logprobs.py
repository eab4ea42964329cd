"""Prompt logprobs in the executor, on a random tiny Llama in float32 against
transformers' log_softmax: prefill in chunks, both runner paths (ModelRunner +
Executor.sample, CudaModelRunner.launch on the CPU), delivered once with the first token."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from flowengine.config import CacheConfig
from flowengine.executor.cuda_runner import CudaModelRunner
from flowengine.executor.executor import Executor
from flowengine.executor.model_runner import ModelRunner
from flowengine.messages import CachedRequestData, NewRequestData, StepPlan
from flowengine.model.model_config import ModelConfig
from flowengine.sampling_params import SamplingParams

BLOCK = 4
VOCAB = 128


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, LlamaForCausalLM]:
    path = str(tmp_path_factory.mktemp("tiny"))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, initializer_range=0.2)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(path, safe_serialization=True)
    return path, model.eval()


@pytest.mark.parametrize("runner_cls", [ModelRunner, CudaModelRunner])
@pytest.mark.parametrize("k", [0, 3, -1])
def test_chunked_prompt_logprobs_match_transformers(tiny, runner_cls, k) -> None:
    path, hf = tiny
    runner = runner_cls(ModelConfig.from_pretrained(path), CacheConfig(BLOCK, 32),
                        torch.device("cpu"), torch.float32)
    executor = Executor(runner)
    prompt = torch.randint(0, VOCAB, (13,)).tolist()
    params = SamplingParams(temperature=0, prompt_logprobs=k)
    plain = SamplingParams(temperature=0)
    # "a" (asks) prefills 5 + 5 + 3 tokens; "b" (does not ask) runs beside it in one go.
    new_a = NewRequestData("a", prompt, len(prompt), params, [0, 1, 2, 3], 0, None)
    new_b = NewRequestData("b", prompt[:6], 6, plain, [4, 5], 0, None)
    r0 = executor.execute_model(StepPlan(0, [new_a, new_b], [], [5, 6]))
    assert [s.req_id for s in r0.sampled] == ["b"] and r0.sampled[0].prompt_logprobs is None
    r1 = executor.execute_model(StepPlan(1, [], [CachedRequestData("a", [], 5)], [5]))
    assert r1.sampled == []
    r2 = executor.execute_model(StepPlan(2, [], [CachedRequestData("a", [], 10)], [3]))
    (sampled,) = r2.sampled
    lps = sampled.prompt_logprobs
    assert len(lps) == len(prompt) - 1
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].double(), dim=-1)
    num_top = VOCAB if k == -1 else k
    for p, lp in enumerate(lps):
        tok = prompt[p + 1]
        assert lp.sampled_logprob == pytest.approx(float(ref[p, tok]), abs=1e-5)
        assert lp.sampled_rank == int((ref[p] > ref[p, tok]).sum()) + 1
        assert len(lp.top_token_ids) == num_top
        if num_top:
            assert lp.top_token_ids[0] == int(ref[p].argmax())
            assert lp.top_logprobs[0] == pytest.approx(float(ref[p].max()), abs=1e-5)
    assert sampled.token_ids == [int(ref[-1].argmax())]
    # Delivered once: the next decode step carries none.
    r3 = executor.execute_model(StepPlan(3, [], [CachedRequestData("a", [], 13)], [1]))
    assert r3.sampled[0].prompt_logprobs is None
