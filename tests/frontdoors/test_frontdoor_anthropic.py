"""POST /v1/messages and /v1/messages/count_tokens (Anthropic Messages) through the
official `anthropic` SDK against a live server on the fake engine: texts equal the chat
route's, Anthropic's SSE events, stop reasons, `x-api-key`, errors in Anthropic's shape.

The fake engine echoes its rendered prompt ("role: content" lines, then "assistant:"),
one byte per token, so every expected text is exact. Newer `anthropic` SDKs have no
`temperature` argument; it travels in `extra_body`, as any field the SDK lacks. Error
types are read from the parsed body (`err.body["error"]["type"]`), which every SDK
version keeps, rather than from attributes only newer versions have.
"""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest
from frontdoor_helpers import MODEL, rendered, typed_events
from openai_helpers import API_KEY, strict

from flowengine.entrypoints.openai.protocol_anthropic import (
    AnthropicErrorResponse,
    MessageResponse,
    TokenCount,
)
from flowengine.entrypoints.openai.serving_anthropic import stop_reason_of

GREEDY = {"extra_body": {"temperature": 0}}
USER = [{"role": "user", "content": "hello there"}]


def chat(oai: openai.OpenAI, messages, max_tokens: int, **extra):
    r = oai.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, extra_body=extra
    )
    return r.choices[0].message.content, r.choices[0].finish_reason, r.usage


def assert_anthropic_error(resp: httpx.Response, status: int, error_type: str) -> str:
    """Anthropic's error shape, exactly; returns the message."""
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"] == "application/json"
    body = strict(resp.content, AnthropicErrorResponse)
    assert body.type == "error" and body.error.type == error_type
    assert body.error.message and "Traceback" not in body.error.message
    return body.error.message


def test_create_equals_chat(claude, oai, http, engine):
    m = claude.messages.create(
        model=MODEL, max_tokens=10, messages=USER, system="be kind", **GREEDY
    )
    messages = [{"role": "system", "content": "be kind"}, *USER]
    text, finish, usage = chat(oai, messages, 10)
    assert finish == "length"
    assert [(b.type, b.text) for b in m.content] == [("text", text)]
    assert text == rendered(messages)[:10] == "system: be"
    assert (m.stop_reason, m.stop_sequence) == ("max_tokens", None)
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert m.id.startswith("msg_")
    assert (m.usage.input_tokens, m.usage.output_tokens) == (usage.prompt_tokens, 10)
    assert engine.submitted[-1][1] == messages
    # System as text blocks, content as text blocks: joined with newlines, as chat parts.
    m = claude.messages.create(
        model=MODEL, max_tokens=60, **GREEDY,
        system=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "q1"},
                                         {"type": "text", "text": "q2"}]},
            {"role": "assistant", "content": "r1"},
            {"role": "user", "content": "q3"},
        ],
    )  # fmt: skip
    messages = [
        {"role": "system", "content": "a\nb"},
        {"role": "user", "content": "q1\nq2"},
        {"role": "assistant", "content": "r1"},
        {"role": "user", "content": "q3"},
    ]
    assert engine.submitted[-1][1] == messages
    # The echo wraps around the prompt (46 bytes) to reach 60 tokens.
    assert m.content[0].text == chat(oai, messages, 60)[0] == (rendered(messages) * 2)[:60]
    # The wire body matches the documented schema exactly.
    raw = http.post(
        "/v1/messages", json={"model": MODEL, "max_tokens": 3, "messages": USER, "temperature": 0}
    )
    assert strict(raw.content, MessageResponse).content[0].text == "use"


def test_stop_sequences(claude, oai):
    # NOTE: stop strings of at most 3 bytes: the fake engine's hold-back slices with a
    # negative end while its text is shorter than a longer stop string.
    m = claude.messages.create(
        model=MODEL, max_tokens=50, messages=USER, stop_sequences=["zzz", "the"], **GREEDY
    )
    text, finish, _ = chat(oai, USER, 50, stop=["zzz", "the"])
    assert finish == "stop"
    assert m.content[0].text == text == "user: hello "
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "the")


def test_stop_reasons_of_finish_reasons():
    class Run:
        def __init__(self, finish_reason, stop_reason=None):
            self.finish_reason, self.stop_reason = finish_reason, stop_reason

    assert stop_reason_of(Run("stop")) == ("end_turn", None)  # EOS
    assert stop_reason_of(Run("stop", 128009)) == ("end_turn", None)  # a stop token id
    assert stop_reason_of(Run("stop", "###")) == ("stop_sequence", "###")
    assert stop_reason_of(Run("length")) == ("max_tokens", None)
    assert stop_reason_of(Run("abort")) == (None, None)


def test_stream_events(claude, http):
    whole = claude.messages.create(model=MODEL, max_tokens=8, messages=USER, **GREEDY)
    raw = http.post(
        "/v1/messages",
        json={"model": MODEL, "max_tokens": 8, "messages": USER, "stream": True, "temperature": 0},
    )
    assert raw.status_code == 200 and raw.headers["content-type"] == "text/event-stream"
    events = typed_events(raw.content)
    names = [name for name, _ in events]
    num_deltas = names.count("content_block_delta")
    assert num_deltas >= 1
    assert names == [
        "message_start", "content_block_start", "ping",
        *["content_block_delta"] * num_deltas,
        "content_block_stop", "message_delta", "message_stop",
    ]  # fmt: skip
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"] == {"input_tokens": whole.usage.input_tokens, "output_tokens": 0}
    assert events[1][1] == {
        "type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""},
    }  # fmt: skip
    deltas = [d for name, d in events if name == "content_block_delta"]
    assert all(d["index"] == 0 and d["delta"]["type"] == "text_delta" for d in deltas)
    assert "".join(d["delta"]["text"] for d in deltas) == whole.content[0].text == "user: he"
    assert events[-2][1]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert events[-2][1]["usage"]["output_tokens"] == 8
    # The SDK's stream helper accumulates the same message.
    with claude.messages.stream(model=MODEL, max_tokens=8, messages=USER, **GREEDY) as stream:
        assert stream.get_final_text() == whole.content[0].text
        final = stream.get_final_message()
    assert (final.stop_reason, final.usage.output_tokens) == ("max_tokens", 8)
    # And create(stream=True) yields the raw events, ping skipped.
    kinds = [e.type for e in claude.messages.create(
        model=MODEL, max_tokens=8, messages=USER, stream=True, stop_sequences=["hello"], **GREEDY
    )]  # fmt: skip
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_empty_system_is_no_system_prompt(claude, http, engine):
    """`system: ""` or `[]` says nothing: no system turn is rendered (the chat
    template's default system prompt applies, as without `system`; vLLM's Messages
    route does the same), rather than an empty system turn."""
    for system in ("", []):
        m = claude.messages.create(model=MODEL, max_tokens=1, messages=USER, system=system,
                                   **GREEDY)  # fmt: skip
        assert engine.submitted[-1][1] == USER
        assert m.usage.input_tokens == len(rendered(USER))
        count = claude.messages.count_tokens(model=MODEL, messages=USER, system=system)
        assert count.input_tokens == len(rendered(USER))


def test_count_tokens_is_the_messages_input_tokens(claude, http):
    for system, messages in [
        (None, USER),
        ("rules", [*USER, {"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]),
    ]:
        kwargs = {} if system is None else {"system": system}
        count = claude.messages.count_tokens(model=MODEL, messages=messages, **kwargs)
        m = claude.messages.create(model=MODEL, max_tokens=1, messages=messages, **kwargs, **GREEDY)
        chat_messages = [] if system is None else [{"role": "system", "content": system}]
        assert (
            count.input_tokens == m.usage.input_tokens == len(rendered([*chat_messages, *messages]))
        )
    raw = http.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": USER})
    assert strict(raw.content, TokenCount).input_tokens == len(rendered(USER))


def test_auth_x_api_key_and_bearer(server):
    def post(headers: dict[str, str], path: str = "/v1/messages") -> httpx.Response:
        body = {"model": MODEL, "max_tokens": 2, "messages": USER, "temperature": 0}
        return httpx.post(f"{server.base_url}{path}", json=body, headers=headers, timeout=30)

    assert post({"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}).status_code == 200
    assert post({"authorization": f"Bearer {API_KEY}"}).status_code == 200
    message = assert_anthropic_error(post({"x-api-key": "wrong"}), 401, "authentication_error")
    assert "x-api-key" in message
    assert_anthropic_error(post({}), 401, "authentication_error")
    # count_tokens too; the OpenAI routes take only the Bearer header.
    assert post({"x-api-key": API_KEY}, "/v1/messages/count_tokens").status_code == 200
    resp = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={"messages": USER}, headers={"x-api-key": API_KEY}, timeout=30,
    )  # fmt: skip
    assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
    # The SDK with a wrong key, and with a Bearer token instead.
    wrong = anthropic.Anthropic(base_url=server.base_url, api_key="nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as err:
        wrong.messages.create(model=MODEL, max_tokens=2, messages=USER)
    assert err.value.body["error"]["type"] == "authentication_error"
    bearer = anthropic.Anthropic(base_url=server.base_url, auth_token=API_KEY, max_retries=0)
    assert (
        bearer.messages.create(model=MODEL, max_tokens=2, messages=USER, **GREEDY).content[0].text
        == "us"
    )


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"model": MODEL, "messages": USER}, "max_tokens"),  # required, as Anthropic requires
        ({"model": MODEL, "max_tokens": 0, "messages": USER}, "max_tokens"),
        ({"max_tokens": 5, "messages": USER}, "model"),
        ({"model": MODEL, "max_tokens": 5, "messages": []}, "messages"),
        ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]},
         "role"),
        ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": "1"}]}]}, "tool_result"),
        ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "assistant", "content": [
            {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}, "tool_use"),
        ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {}}]}]}, "image"),
        ({"model": MODEL, "max_tokens": 5, "messages": USER, "tool_choice": {"type": "any"},
          "tools": [{"name": "f", "input_schema": {"type": "string"}}]}, "input_schema"),
        ({"model": MODEL, "max_tokens": 5, "messages": USER,
          "tools": [{"name": "f", "input_schema": {}}]}, "--enable-auto-tool-choice"),
        ({"model": MODEL, "max_tokens": 5, "messages": USER, "tool_choice": {"type": "any"}},
         "tool_choice"),
        ({"model": MODEL, "max_tokens": 5, "messages": USER,
          "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"model": MODEL, "max_tokens": 5, "messages": USER,
          "output_config": {"format": {"type": "json_schema", "schema": {}}}}, "output_config"),
        ({"model": MODEL, "max_tokens": 5, "messages": USER, "temperature": -0.5}, "temperature"),
        ({"model": MODEL, "max_tokens": 5, "messages": USER,
          "system": [{"type": "text", "text": "a"}, {"type": "text", "text": ""}]},
         "system[1].text: text content blocks must be non-empty"),
        ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "x" * 600}]},
         "max_model_len"),
    ],
)  # fmt: skip
def test_bad_input_is_an_anthropic_400(http, body, words):
    message = assert_anthropic_error(http.post("/v1/messages", json=body), 400,
                                     "invalid_request_error")  # fmt: skip
    assert words in message
    ok = http.post(
        "/v1/messages", json={"model": MODEL, "max_tokens": 2, "messages": USER, "temperature": 0}
    )
    assert ok.status_code == 200 and ok.json()["content"][0]["text"] == "us"


def test_app_errors_have_anthropic_shape(http):
    assert_anthropic_error(
        http.post("/v1/messages", content=b"{not json", headers={"content-type": "application/json"}),
        400, "invalid_request_error",
    )  # fmt: skip
    assert_anthropic_error(
        http.post("/v1/messages", content=b"{}", headers={"content-type": "text/plain",
                                                          "origin": "https://x.example"}),
        415, "invalid_request_error",
    )  # fmt: skip
    resp = http.get("/v1/messages")
    assert_anthropic_error(resp, 405, "invalid_request_error")
    assert resp.headers["allow"] == "POST"
    assert_anthropic_error(http.post("/v1/messages", content=b"x" * (70 * 1024)), 413,
                           "request_too_large")  # fmt: skip
    message = assert_anthropic_error(
        http.post("/v1/messages", json={"model": "other", "max_tokens": 2, "messages": USER}),
        404, "not_found_error",
    )  # fmt: skip
    assert "other" in message
    # The OpenAI routes keep OpenAI's shape.
    assert set(http.get("/v1/chat/completions").json()) == {"error"}


def test_sdk_error_classes(claude):
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model=MODEL, max_tokens=5, messages=USER,
                               tools=[{"name": "f", "input_schema": {"type": "object"}}])  # fmt: skip
    assert err.value.body["error"]["type"] == "invalid_request_error"
    assert "--enable-auto-tool-choice" in err.value.message  # auto: not parsed here
    with pytest.raises(anthropic.NotFoundError) as err:
        claude.messages.create(model="claude-none", max_tokens=5, messages=USER)
    assert err.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": "1"}]}])  # fmt: skip
    assert (
        claude.messages.create(model=MODEL, max_tokens=2, messages=USER, **GREEDY).content[0].text
        == "us"
    )


def test_engine_failure_mid_stream_is_an_error_event(claude, engine, http):
    engine.fail_after_tokens = 3
    try:
        raw = http.post(
            "/v1/messages",
            json={"model": MODEL, "max_tokens": 20, "messages": USER, "stream": True},
        )
        with pytest.raises(anthropic.APIStatusError) as err:
            with claude.messages.stream(model=MODEL, max_tokens=20, messages=USER) as stream:
                stream.get_final_text()
    finally:
        engine.fail_after_tokens = None
    events = typed_events(raw.content)
    assert events[-1][0] == "error"
    assert events[-1][1] == {
        "type": "error",
        "error": {"type": "api_error", "message": "internal server error; see the server log"},
    }
    assert err.value.body["error"]["type"] == "api_error"
    assert (
        claude.messages.create(model=MODEL, max_tokens=2, messages=USER, **GREEDY).content[0].text
        == "us"
    )


def test_openapi_documents_anthropic_errors_and_auth(http):
    doc = http.get("/openapi.json").json()
    op = doc["paths"]["/v1/messages"]["post"]
    error_schema = op["responses"]["default"]["content"]["application/json"]["schema"]
    assert error_schema == {"$ref": "#/components/schemas/AnthropicErrorResponse"}
    assert op["security"] == [{"bearer": []}, {"x_api_key": []}]
    assert doc["components"]["securitySchemes"]["x_api_key"] == {
        "type": "apiKey", "in": "header", "name": "x-api-key",
    }  # fmt: skip
    required = doc["components"]["schemas"]["MessagesRequest"]["required"]
    assert sorted(required) == ["max_tokens", "messages", "model"]
    assert set(doc["paths"]["/v1/messages/count_tokens"]) == {"post"}


def test_admission_and_metrics_are_the_chat_routes(claude, oai, engine, http):
    def e2e_count() -> float:
        for line in http.get("/metrics").text.splitlines():
            if line.startswith("flowengine:e2e_request_latency_seconds_count"):
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError("no e2e histogram")

    before = e2e_count()
    claude.messages.create(model=MODEL, max_tokens=2, messages=USER, **GREEDY)
    oai.responses.create(model=MODEL, input="x", max_output_tokens=2, temperature=0)
    assert e2e_count() == before + 2
    engine.max_running = 0  # the engine's queue is full
    try:
        with pytest.raises(anthropic.RateLimitError) as err:
            claude.messages.create(model=MODEL, max_tokens=2, messages=USER)
        assert err.value.body["error"]["type"] == "rate_limit_error"
        assert err.value.response.headers["retry-after"] == "2"
        with pytest.raises(openai.RateLimitError) as oerr:
            oai.responses.create(model=MODEL, input="x")
        assert oerr.value.body["code"] == "queue_full"
    finally:
        engine.max_running = None
    assert (
        claude.messages.create(model=MODEL, max_tokens=2, messages=USER, **GREEDY).content[0].text
        == "us"
    )


def test_behind_a_root_path_proxy():
    from openai_fake_engine import FakeEngine
    from openai_live_server import LiveServer

    from flowengine.entrypoints.openai.app import AppOptions

    with LiveServer(FakeEngine(), app_options=AppOptions(root_path="/llm")) as live:
        c = anthropic.Anthropic(base_url=f"{live.base_url}/llm", api_key="x", max_retries=0)
        m = c.messages.create(model=MODEL, max_tokens=2, messages=USER, **GREEDY)
        assert m.content[0].text == "us"
        resp = httpx.get(f"{live.base_url}/llm/v1/messages")
        assert_anthropic_error(resp, 405, "invalid_request_error")
