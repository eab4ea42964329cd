"""Greedy token ids equal Hugging Face transformers' (same weights, float32).

The acceptance cases of the engine-core issue: 16 varied prompts one by one and in one
batch; again with shared long prefixes (prefix cache hits asserted), with
max_num_batched_tokens=64 (chunked prefill), and with a KV pool so small that requests
are preempted (preemptions asserted). After every run all KV blocks are free again.
"""

from __future__ import annotations

import pytest
from engine_prompts import PROMPTS

from flowengine import LLM, SamplingParams

pytestmark = pytest.mark.slow

MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(hf_model, hf_greedy, prompt_ids) -> list[list[int]]:
    return [hf_greedy(hf_model, ids, MAX_TOKENS) for ids in prompt_ids]


def _generate(llm: LLM, prompt_ids: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _assert_all_blocks_free(llm: LLM) -> None:
    sched = llm.engine.scheduler
    assert sched.num_free_blocks == sched.num_total_blocks
    assert not sched.has_unfinished_requests()


@pytest.fixture(scope="module")
def llm(default_model_path) -> LLM:
    return LLM(default_model_path, enable_prefix_caching=False)


def test_prompt_set_is_varied(prompt_ids):
    assert len(prompt_ids) >= 16
    assert max(map(len, prompt_ids)) > 512


def test_one_by_one_equals_hf(llm, prompt_ids, reference):
    for ids, ref in zip(prompt_ids, reference, strict=True):
        assert _generate(llm, [ids]) == [ref]
    _assert_all_blocks_free(llm)


def test_one_batch_equals_hf(llm, prompt_ids, reference):
    assert _generate(llm, prompt_ids) == reference
    _assert_all_blocks_free(llm)


def test_chunked_prefill_equals_hf(default_model_path, prompt_ids, reference):
    llm = LLM(default_model_path, max_num_batched_tokens=64, enable_prefix_caching=False)
    assert _generate(llm, prompt_ids) == reference
    _assert_all_blocks_free(llm)


def test_preemption_equals_hf(default_model_path, prompt_ids, reference):
    # 90 blocks of 16 tokens: the long prompt (first, so it is admitted first) with its
    # output needs 81, the whole batch 122, so short requests admitted beside it run out
    # of blocks as they grow and are preempted and recomputed.
    llm = LLM(default_model_path, num_kv_blocks=90, enable_prefix_caching=False)
    order = sorted(range(len(prompt_ids)), key=lambda i: -len(prompt_ids[i]))
    outs = _generate(llm, [prompt_ids[i] for i in order])
    assert outs == [reference[i] for i in order]
    assert llm.engine.scheduler.num_preemptions > 0
    _assert_all_blocks_free(llm)


def test_prefix_caching_equals_hf(default_model_path, hf_model, hf_greedy, tokenizer, prompt_ids):
    shared = prompt_ids[13][:400]  # a long shared prefix (the story prompt)
    suffixes = [tokenizer.encode(s) for s in (" Q: who bakes?", " Q: how many crossings?",
                                              " The end.", " Moral:")]
    prompts = [shared + s for s in suffixes]
    reference = [hf_greedy(hf_model, p, MAX_TOKENS) for p in prompts]
    llm = LLM(default_model_path, enable_prefix_caching=True)
    first = llm.generate([{"prompt_token_ids": prompts[0]}], GREEDY, use_tqdm=False)
    rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], GREEDY, use_tqdm=False)
    outs = first + rest
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert first[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens >= 384 for o in rest)  # 24 full blocks of the prefix
    _assert_all_blocks_free(llm)
