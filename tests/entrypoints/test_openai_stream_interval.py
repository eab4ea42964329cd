"""`--stream-interval`: streamed responses on the real engine come in chunks of several
tokens and join to the non-streamed response (text, logprobs, n > 1, stop strings)."""

from __future__ import annotations

import openai
import pytest
from openai_live_server import LiveServer

pytestmark = pytest.mark.slow

INTERVAL = 4


@pytest.fixture(scope="module")
def client(default_model_path):
    from flowengine.entrypoints.async_engine import AsyncEngine

    engine = AsyncEngine(default_model_path, max_model_len=512, stream_interval=INTERVAL)
    server = LiveServer(engine, manage_engine=True).start(timeout_s=600)
    try:
        yield openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    finally:
        server.stop(timeout_s=60)


def test_completion_chunks_join_to_the_whole(client):
    name = client.models.list().data[0].id
    kwargs = dict(model=name, prompt="Once upon a time", max_tokens=13, temperature=1.0,
                  seed=3, n=2, logprobs=2, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, **kwargs))
    for choice in whole.choices:
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert "".join(c.text for c in mine) == choice.text
        tokens = [t for c in mine if c.logprobs for t in c.logprobs.tokens]
        assert tokens == choice.logprobs.tokens and len(tokens) == 13
        # 13 tokens: the first alone, then 4, 4, 4 (fewer chunks if the stream folded)
        texts = [c for c in mine if c.text or c.finish_reason]
        assert len(texts) <= 1 + 3 and mine[-1].finish_reason == "length"


def test_chat_stream_with_a_stop_string_equals_the_whole(client):
    name = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Count from one to twenty in words."}]
    whole = client.chat.completions.create(model=name, messages=messages, max_tokens=40,
                                           temperature=0)
    text = whole.choices[0].message.content
    stop = text.split()[3]  # a word the greedy answer reaches after a few chunks
    whole = client.chat.completions.create(model=name, messages=messages, max_tokens=40,
                                           temperature=0, stop=[stop])
    stream = client.chat.completions.create(model=name, messages=messages, max_tokens=40,
                                            temperature=0, stop=[stop], stream=True)
    chunks = [c for c in stream if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == \
        whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason == "stop"
