"""/v1/chat/completions through the official `openai` SDK and raw HTTP (fake engine).

The fake engine's greedy sample i echoes the templated prompt from offset i; the
template of [{"role": "user", "content": "hello"}] is "user: hello\\nassistant:".
"""

from __future__ import annotations

import orjson
from openai_helpers import sse_events, strict

from flowengine.entrypoints.openai.responses import ChatCompletionChunk, ChatCompletionResponse
from flowengine.sampling_params import SamplingParams

HELLO = [{"role": "user", "content": "hello"}]
TEMPLATED = "user: hello\nassistant:"


def test_chat_greedy_text_usage_and_shape(client, http):
    r = client.chat.completions.create(
        model="fake-model", messages=HELLO, max_tokens=8, temperature=0
    )
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert r.model == "fake-model"
    [choice] = r.choices
    assert (choice.index, choice.message.role) == (0, "assistant")
    assert choice.message.content == TEMPLATED[:8]
    assert choice.finish_reason == "length" and choice.logprobs is None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (22, 8, 30)
    raw = http.post(
        "/v1/chat/completions",
        json={"model": "alias", "messages": HELLO, "max_tokens": 3, "temperature": 0},
    )
    body = strict(raw.content, ChatCompletionResponse)
    assert body.model == "alias" and body.choices[0].message.content == "use"


def test_chat_stream_role_chunk_first_then_content_usage_done(http):
    req = {
        "messages": HELLO,
        "max_tokens": 6,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    resp = http.post("/v1/chat/completions", json=req)
    assert resp.status_code == 200
    assert resp.headers["content-type"] == "text/event-stream"
    chunks = [strict(p, ChatCompletionChunk) for p in sse_events(resp.content)]
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"
    first = chunks[0].choices[0]
    assert (first.delta.role, first.delta.content, first.finish_reason) == ("assistant", "", None)
    body = chunks[1:-1]
    assert "".join(c.choices[0].delta.content or "" for c in body) == TEMPLATED[:6]
    assert [c.choices[0].finish_reason for c in body][-1] == "length"
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == []
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (22, 6)


def test_chat_stream_through_sdk_without_usage(client):
    stream = client.chat.completions.create(
        model="fake-model", messages=HELLO, max_tokens=5, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == TEMPLATED[:5]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)


def test_chat_n2(client):
    r = client.chat.completions.create(
        model="fake-model", messages=HELLO, max_tokens=4, temperature=0, n=2
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.message.content for c in r.choices] == ["user", "ser:"]
    assert r.usage.completion_tokens == 8


def test_chat_n2_stream_has_a_role_chunk_per_choice(client):
    chunks = list(
        client.chat.completions.create(
            model="fake-model", messages=HELLO, max_tokens=3, temperature=0, n=2, stream=True
        )
    )
    assert [(c.choices[0].index, c.choices[0].delta.role) for c in chunks[:2]] == [
        (0, "assistant"),
        (1, "assistant"),
    ]
    texts = ["", ""]
    for c in chunks[2:]:
        texts[c.choices[0].index] += c.choices[0].delta.content or ""
    assert texts == ["use", "ser"]


def test_chat_logprobs_top_logprobs(client):
    r = client.chat.completions.create(
        model="fake-model",
        messages=HELLO,
        max_tokens=2,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = r.choices[0].logprobs.content
    assert [t.token for t in content] == ["u", "s"]
    assert [t.logprob for t in content] == [-0.25, -0.25]
    assert content[0].bytes == [117]
    assert [(t.token, t.logprob) for t in content[0].top_logprobs] == [
        ("u", -0.25),
        ("v", -0.5),
        ("w", -0.75),
    ]
    r0 = client.chat.completions.create(
        model="fake-model", messages=HELLO, max_tokens=1, temperature=0, logprobs=True
    )
    assert r0.choices[0].logprobs.content[0].top_logprobs == []


def test_chat_stop_strings(client):
    r = client.chat.completions.create(
        model="fake-model", messages=HELLO, max_tokens=20, temperature=0, stop=[": h"]
    )
    assert r.choices[0].message.content == "user"
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == ": h"
    r = client.chat.completions.create(
        model="fake-model",
        messages=HELLO,
        max_tokens=20,
        temperature=0,
        stop=": h",
        extra_body={"include_stop_str_in_output": True},
        stream=True,
    )
    assert "".join(c.choices[0].delta.content or "" for c in r) == "user: h"


def test_chat_seeded_sampling_is_repeatable(client):
    def sample(seed: int) -> str:
        r = client.chat.completions.create(
            model="fake-model", messages=HELLO, max_tokens=16, temperature=1.0, seed=seed
        )
        return r.choices[0].message.content

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_chat_vllm_extras_reach_sampling_params(client, engine):
    client.chat.completions.create(
        model="fake-model", messages=HELLO, max_completion_tokens=3, max_tokens=9,
        temperature=0.5, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.25, seed=3,
        extra_body={
            "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "ignore_eos": True,
            "min_tokens": 2, "skip_special_tokens": False, "include_stop_str_in_output": True,
            "stop_token_ids": [0, 7], "spaces_between_special_tokens": False,
        },
    )  # fmt: skip
    request_id, prompt, params = engine.submitted[-1]
    assert request_id.startswith("chatcmpl-") and prompt == HELLO
    assert params == SamplingParams(
        n=1, temperature=0.5, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.25,
        seed=3, top_k=5, min_p=0.1, repetition_penalty=1.2, ignore_eos=True, min_tokens=2,
        max_tokens=3, skip_special_tokens=False, include_stop_str_in_output=True,
        stop_token_ids=[0, 7], spaces_between_special_tokens=False,
    )  # fmt: skip


def test_chat_roles_and_text_parts(http, engine):
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "ok"},
        {"role": "system", "content": "s"},
        {"role": "user", "content": "again"},
    ]
    resp = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
    assert resp.status_code == 200
    assert engine.submitted[-1][1] == [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "ok"},
        {"role": "system", "content": "s"},
        {"role": "user", "content": "again"},
    ]
    # Unset max tokens: up to the context limit (SamplingParams max_tokens=None).
    assert engine.submitted[-1][2].max_tokens == 1
    http.post("/v1/chat/completions", content=orjson.dumps({"messages": HELLO, "stop": "x"}))
    assert engine.submitted[-1][2].max_tokens is None
    assert engine.submitted[-1][2].temperature == 1.0
