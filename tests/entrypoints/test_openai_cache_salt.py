"""`cache_salt` on the OpenAI routes (vLLM's request field), through the `openai` SDK on
the real engine: the same salt hits the prefix cache, another salt or none misses."""

from __future__ import annotations

import openai
import pytest
from openai_live_server import LiveServer

pytestmark = pytest.mark.slow

# 70 tokens of a repeated sentence: several full blocks of 16 to hit.
PROMPT = "The quick brown fox jumps over the lazy dog. " * 7


@pytest.fixture(scope="module")
def live(default_model_path):
    from flowengine.entrypoints.async_engine import AsyncEngine

    engine = AsyncEngine(default_model_path, max_model_len=512, num_kv_blocks=128)
    server = LiveServer(engine, manage_engine=True).start(timeout_s=600)
    try:
        yield server, engine
    finally:
        server.stop(timeout_s=60)


def _hit_tokens(engine, call) -> int:
    before = engine.get_stats().prefix_cache_hits_total
    call()
    return engine.get_stats().prefix_cache_hits_total - before


def test_completions_cache_salt(live, tokenizer) -> None:
    server, engine = live
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    name = client.models.list().data[0].id
    num_prompt = len(tokenizer.encode(PROMPT))
    expected_hit = (num_prompt - 1) // 16 * 16  # full blocks before the last prompt token
    texts = []

    def complete(salt: str | None):
        def call():
            extra = {} if salt is None else {"cache_salt": salt}
            r = client.completions.create(
                model=name, prompt=PROMPT, max_tokens=3, temperature=0, extra_body=extra
            )
            texts.append(r.choices[0].text)

        return call

    assert _hit_tokens(engine, complete("tenant-a")) == 0
    assert _hit_tokens(engine, complete("tenant-a")) == expected_hit
    assert _hit_tokens(engine, complete("tenant-b")) == 0
    assert _hit_tokens(engine, complete(None)) == 0
    assert _hit_tokens(engine, complete(None)) == expected_hit
    assert len(set(texts)) == 1  # the salt changes caching, never the answer


def test_chat_cache_salt_and_bad_salt(live, tokenizer) -> None:
    from flowengine.tokenize.chat import apply_chat_template

    server, engine = live
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    name = client.models.list().data[0].id
    messages = [{"role": "user", "content": PROMPT}]
    num_prompt = len(apply_chat_template(tokenizer, messages, add_generation_prompt=True))

    def chat(salt: str):
        return lambda: client.chat.completions.create(
            model=name,
            messages=messages,
            max_tokens=2,
            temperature=0,
            extra_body={"cache_salt": salt},
        )

    assert _hit_tokens(engine, chat("chat-a")) == 0
    assert _hit_tokens(engine, chat("chat-a")) == (num_prompt - 1) // 16 * 16
    assert _hit_tokens(engine, chat("chat-b")) == 0
    with pytest.raises(openai.BadRequestError, match="cache_salt must be a non-empty string"):
        chat("")()
