"""The server on the real `AsyncEngine` and the default model (SmolLM2-135M-Instruct):
texts equal the offline `LLM` API's, disconnects free KV blocks, 200 concurrent streams."""

from __future__ import annotations

import asyncio
import gc

import httpx
import openai
import pytest
from openai_helpers import assert_error, stream_text, wait_until
from openai_live_server import LiveServer

from flowengine.config import EngineArgs
from flowengine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time", "1, 2, 3,"]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}],
]
MAX_TOKENS = 10
MAX_MODEL_LEN = 1024


@pytest.fixture(scope="module")
def model_path() -> str:
    from flowengine.engine.builder import resolve

    return resolve(EngineArgs()).model_path


@pytest.fixture(scope="module")
def offline(model_path) -> tuple[list[str], list[str]]:
    """Greedy texts of the offline API: completions (ignore_eos) and chats."""
    from flowengine.entrypoints.llm import LLM

    llm = LLM(model_path, max_model_len=MAX_MODEL_LEN)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    texts = [o.outputs[0].text for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    chat = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    chats = [o.outputs[0].text for o in llm.chat(CHATS, chat, use_tqdm=False)]
    del llm
    gc.collect()
    return texts, chats


@pytest.fixture(scope="module")
def live(model_path, offline):
    from flowengine.entrypoints.async_engine import AsyncEngine

    engine = AsyncEngine(model_path, max_model_len=MAX_MODEL_LEN)
    server = LiveServer(engine, manage_engine=True).start(timeout_s=600)
    try:
        yield server
    finally:
        server.stop(timeout_s=60)


@pytest.fixture
def client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.base_url}/v1", api_key="unused", max_retries=0)


def test_completions_equal_offline(client, offline):
    texts, _ = offline
    name = client.models.list().data[0].id
    r = client.completions.create(
        model=name, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.text for c in r.choices] == texts
    assert r.usage.completion_tokens == MAX_TOKENS * len(PROMPTS)
    stream = client.completions.create(
        model=name, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in stream) == texts[0]


def test_chat_equal_offline(client, offline):
    _, chats = offline
    name = client.models.list().data[0].id
    for messages, expected in zip(CHATS, chats, strict=True):
        r = client.chat.completions.create(
            model=name, messages=messages, max_tokens=MAX_TOKENS, temperature=0
        )
        assert r.choices[0].message.content == expected
        stream = client.chat.completions.create(
            model=name, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream) == expected


def test_seed_logprobs_stop_and_errors(client, live, offline):
    name = client.models.list().data[0].id

    def sample() -> list[str]:
        r = client.completions.create(
            model=name, prompt=PROMPTS[2], max_tokens=12, temperature=1.0, seed=5, n=2
        )
        return [c.text for c in r.choices]

    assert sample() == sample()
    r = client.chat.completions.create(
        model=name, messages=CHATS[0], max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    for tok in r.choices[0].logprobs.content:
        tops = [t.logprob for t in tok.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert tok.logprob == tops[0]  # greedy: the sampled token is the most likely
    first_word = offline[0][0].split()[0]  # e.g. "Paris"
    r = client.completions.create(
        model=name, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, stop=[first_word]
    )
    assert r.choices[0].finish_reason == "stop" and first_word not in r.choices[0].text
    resp = httpx.post(
        f"{live.base_url}/v1/completions", json={"prompt": "hi " * 1100, "max_tokens": 2}
    )
    err = assert_error(resp, 400)
    assert f"max_model_len is {MAX_MODEL_LEN}" in err["message"] and "1101 tokens" in err["message"]


def test_200_streams_and_50_disconnects_free_every_block(live, offline):
    """Each full stream gets its greedy text; after the 50 disconnects every KV block is
    free again (read from the in-process scheduler: `get_stats()` is a snapshot that
    only refreshes when the engine emits outputs)."""
    texts, _ = offline
    engine = live.engine
    scheduler = engine.core.scheduler
    # A stop string ends a request in the frontend first; its engine-side abort (which
    # frees the blocks) follows asynchronously, so let earlier requests settle.
    wait_until(lambda: not scheduler.has_unfinished_requests(), 30)
    baseline = scheduler.num_free_blocks
    assert baseline == scheduler.num_total_blocks

    async def run() -> list[tuple[str, str]]:
        limits = httpx.Limits(max_connections=250, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=live.base_url, timeout=600, limits=limits) as c:
            jobs = [
                stream_text(
                    c,
                    PROMPTS[i % len(PROMPTS)],
                    MAX_TOKENS,
                    3 if i % 4 == 0 else None,
                    ignore_eos=True,
                )  # fmt: skip
                for i in range(200)
            ]
            return await asyncio.gather(*jobs)

    results = asyncio.run(run())
    for i, (_, text) in enumerate(results):
        if i % 4:
            assert text == texts[i % len(PROMPTS)], i
    wait_until(lambda: not scheduler.has_unfinished_requests(), 60)
    wait_until(lambda: scheduler.num_free_blocks == baseline, 60)
    # A disconnected stream's handler leaves the in-flight count in its own cleanup,
    # after the engine has freed the request: wait for it as for the blocks above.
    wait_until(lambda: live.server.app.num_in_flight == 0, 30)
    assert engine.get_stats().num_running == 0 and live.server.app.num_in_flight == 0
