"""`use_beam_search` over HTTP (openai SDK, extra_body) on the real engine: the
choices are `LLM.beam_search`'s sequences, streamed or not, on completions and chat;
fields beam search cannot honour are a 400 naming them."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import openai
import pytest

from flowengine.beam_search import BeamSearchParams

sys.path.insert(0, str(Path(__file__).parent.parent / "entrypoints"))
from openai_helpers import assert_error, wait_until  # noqa: E402
from openai_live_server import LiveServer  # noqa: E402

MAX_TOKENS = 4
PROMPTS = ["The capital of France is", "def add(a, b):"]
CHAT = [{"role": "user", "content": "What is 2+2? Answer with one number."}]


@pytest.fixture(scope="module")
def live(default_model_path):
    from flowengine.entrypoints.async_engine import AsyncEngine

    engine = AsyncEngine(default_model_path, dtype="float32", max_model_len=256,
                         block_size=16)
    server = LiveServer(engine, manage_engine=True).start(timeout_s=600)
    try:
        yield server
    finally:
        server.stop(timeout_s=60)


@pytest.fixture(scope="module")
def client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.base_url}/v1", api_key="unused", max_retries=0)


def offline(llm, prompts, width, **kwargs):
    params = BeamSearchParams(beam_width=width, max_tokens=MAX_TOKENS, **kwargs)
    return llm.beam_search(prompts, params)


def test_completions_with_beam_search(client, beam_llm):
    ref = offline(beam_llm, PROMPTS, 2, length_penalty=0.5)
    body = {"use_beam_search": True, "length_penalty": 0.5}
    r = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPTS,
                                  max_tokens=MAX_TOKENS, n=2, extra_body=body)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [s.text for o in ref for s in o.sequences]
    assert [c.finish_reason for c in r.choices] == [
        s.finish_reason for o in ref for s in o.sequences]
    assert r.usage.completion_tokens == sum(
        len(s.output_token_ids) for o in ref for s in o.sequences)
    assert r.usage.prompt_tokens == sum(s.num_prompt_tokens for o in ref
                                        for s in o.sequences[:1])
    # Streamed: vLLM's shape, each choice's whole text in one chunk, then [DONE].
    stream = client.completions.create(
        model=r.model, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, n=2, stream=True,
        stream_options={"include_usage": True}, extra_body=body)
    chunks = list(stream)
    texts = {c.choices[0].index: c.choices[0].text for c in chunks if c.choices}
    assert texts == {0: ref[0].sequences[0].text, 1: ref[0].sequences[1].text}
    assert chunks[-1].usage.completion_tokens == sum(
        len(s.output_token_ids) for s in ref[0].sequences)


def test_best_of_is_the_beam_width(client, beam_llm):
    ref = offline(beam_llm, PROMPTS[:1], 4, early_stopping=True)
    r = client.completions.create(
        model=client.models.list().data[0].id, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
        n=2, extra_body={"use_beam_search": True, "best_of": 4, "early_stopping": True})
    assert [c.text for c in r.choices] == [s.text for s in ref[0].sequences[:2]]


def test_chat_with_beam_search(client, beam_llm):
    text, ids = beam_llm.input_processor.chat_prompt(CHAT, add_generation_prompt=True)
    ref = offline(beam_llm, [{"prompt_token_ids": ids}], 2)
    name = client.models.list().data[0].id
    r = client.chat.completions.create(model=name, messages=CHAT, max_tokens=MAX_TOKENS,
                                       n=2, extra_body={"use_beam_search": True})
    assert [c.message.content for c in r.choices] == [s.text for s in ref[0].sequences]
    assert r.usage.prompt_tokens == len(ids)
    stream = client.chat.completions.create(
        model=name, messages=CHAT, max_tokens=MAX_TOKENS, n=2, stream=True,
        extra_body={"use_beam_search": True})
    contents = {0: "", 1: ""}
    for chunk in stream:
        for c in chunk.choices:
            contents[c.index] += c.delta.content or ""
    assert contents == {0: ref[0].sequences[0].text, 1: ref[0].sequences[1].text}


def test_truncate_prompt_tokens_truncates_the_searched_prompt(client, beam_llm):
    # vLLM's truncate_prompt_tokens holds with use_beam_search too (found by a fresh
    # tester: it was ignored, the search ran on the whole prompt).
    ids = beam_llm.get_tokenizer().encode(PROMPTS[0])
    ref = offline(beam_llm, [{"prompt_token_ids": ids[-3:]}], 2)
    r = client.completions.create(
        model=client.models.list().data[0].id, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
        n=2, extra_body={"use_beam_search": True, "truncate_prompt_tokens": 3})
    assert [c.text for c in r.choices] == [s.text for s in ref[0].sequences]
    assert r.usage.prompt_tokens == 3


def test_a_salted_search_is_cached_under_its_salt_only(live, client):
    # cache_salt holds for every step of an HTTP search (found by a fresh tester: the
    # steps after the first ran unsalted, so an unsalted request hit the tenant's
    # prompt blocks in the prefix cache).
    import asyncio

    from flowengine.sampling_params import SamplingParams

    prompt = list(range(1000, 1040))  # 2 full blocks + 8 tokens; no other test sends it
    client.completions.create(
        model=client.models.list().data[0].id, prompt=prompt, max_tokens=3, n=2,
        extra_body={"use_beam_search": True, "cache_salt": "tenant-a"})

    async def num_cached_tokens(salt):
        one = {"prompt_token_ids": prompt} if salt is None else {
            "prompt_token_ids": prompt, "cache_salt": salt}
        outs = [out async for out in live.engine.submit(one, SamplingParams(max_tokens=1))]
        return outs[-1].num_cached_tokens

    def cached(salt):
        return asyncio.run_coroutine_threadsafe(num_cached_tokens(salt), live.loop).result(60)

    assert (cached(None), cached("tenant-b")) == (0, 0)
    assert cached("tenant-a") == 32


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"stop": ["x"]}, "stop", "stop cannot be used with use_beam_search"),
        ({"logprobs": 2}, "logprobs", "logprobs cannot be used with use_beam_search"),
        ({"top_p": 0.5}, "top_p", "top_p cannot be used with use_beam_search"),
        ({"n": 3, "best_of": 2}, "best_of", "n=3 is more than best_of=2"),
        ({"n": 129}, "n", "over this server's limit of"),
        ({"n": 11}, "n", "n=11 beams need the top 22 log-probabilities per step, over "
                         "this server's limit of 20 (--max-logprobs)"),
        ({"length_penalty": "long"}, "length_penalty", None),
        ({"early_stopping": "sometimes"}, "early_stopping", None),
    ],
)
def test_beam_search_input_errors(live, extra, param, message):
    body = {"prompt": "abc", "max_tokens": 2, "use_beam_search": True, **extra}
    resp = httpx.post(f"{live.base_url}/v1/completions", json=body, timeout=120)
    err = assert_error(resp, 400, param=param)
    if message is not None:
        assert message in err["message"]


def test_async_engine_beam_search_equals_offline(live, beam_llm):
    import asyncio

    params = BeamSearchParams(beam_width=3, max_tokens=MAX_TOKENS, length_penalty=2.0)
    ref = beam_llm.beam_search(PROMPTS[1:], params)[0]
    # On the server's own loop, while it serves (the engine lives there).
    future = asyncio.run_coroutine_threadsafe(
        live.engine.beam_search(PROMPTS[1], params), live.loop)
    out = future.result(timeout=300)
    assert [(s.tokens, s.text, s.finish_reason) for s in out.sequences] == [
        (s.tokens, s.text, s.finish_reason) for s in ref.sequences]
    assert [s.score for s in out.sequences] == pytest.approx(
        [s.score for s in ref.sequences], abs=1e-5)


def test_cancelling_a_search_aborts_its_requests(live):
    import asyncio
    import concurrent.futures

    engine = live.engine
    pool = engine.core.scheduler.kv_cache_manager.block_pool
    params = BeamSearchParams(beam_width=4, max_tokens=200, ignore_eos=True)
    future = asyncio.run_coroutine_threadsafe(engine.beam_search(PROMPTS[0], params),
                                              live.loop)
    wait_until(lambda: pool.ref_counts() != {}, timeout_s=120)  # a step runs
    future.cancel()  # cancels the task on the server's loop (a client gone, too)
    with pytest.raises(concurrent.futures.CancelledError):
        future.result(timeout=60)
    # Every step request was aborted: nothing runs, no block is held.
    wait_until(lambda: not engine._has_unfinished_requests() and pool.ref_counts() == {},
               timeout_s=60)
