"""Hostile and careless inputs on the tool paths of POST /v1/responses and POST
/v1/messages (and /v1/messages/count_tokens): each is a 400 in the route's own error
shape naming the field, nothing reaches the engine, and the server keeps serving.

Rules checked are the APIs' own: Anthropic refuses messages with empty content (other
than a final assistant message), empty text blocks, tool_use ids used twice, and
tool_result blocks after
text in a user message; a call_id that two function_call items share cannot be
answered unambiguously; count_tokens checks tool_choice as /v1/messages does."""

from __future__ import annotations

import pytest
from frontdoor_helpers import MODEL
from openai_helpers import strict

from flowengine.entrypoints.openai.protocol_anthropic import AnthropicErrorResponse

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}}
A_TOOLS = [{"name": "get_weather", "input_schema": WEATHER}]
R_TOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]


def _use(*ids: str) -> dict:
    return {"role": "assistant", "content": [
        {"type": "tool_use", "id": i, "name": "get_weather", "input": {}} for i in ids]}  # fmt: skip


def _result(i: str) -> dict:
    return {"type": "tool_result", "tool_use_id": i, "content": "sunny"}


Q = {"role": "user", "content": "weather?"}
ANTHROPIC_BAD = [
    # (messages, the field named, words of the message)
    ([Q, _use("t1", "t1"), {"role": "user", "content": [_result("t1")]}],
     "messages[1].content[1].id", "unique"),
    ([Q, _use("t1"), {"role": "user", "content": [{"type": "text", "text": "here:"},
                                                  _result("t1")]}],
     "messages[2].content[1]", "must come first"),
    ([{"role": "user", "content": []}], "messages[0].content", "non-empty content"),
    ([Q, {"role": "assistant", "content": ""}, Q], "messages[1].content", "non-empty content"),
    # An empty text block, as `content: ""` (Anthropic: "text content blocks must be
    # non-empty"), also beside other blocks and in a final assistant message (whose
    # content may be empty, "" or [], but not hold an empty block).
    ([{"role": "user", "content": [{"type": "text", "text": ""}]}],
     "messages[0].content[0].text", "must be non-empty"),
    ([Q, _use("t1"), {"role": "user", "content": [_result("t1"), {"type": "text", "text": ""}]}],
     "messages[2].content[1].text", "must be non-empty"),
    ([Q, {"role": "assistant", "content": [{"type": "text", "text": ""}]}],
     "messages[1].content[0].text", "must be non-empty"),
    ([Q, _use("t1"), {"role": "user", "content": [{**_result("t1"), "content": [
        {"type": "text", "text": ""}]}]}], "messages[2].content[0].content[0].text", "non-empty"),
]  # fmt: skip


@pytest.mark.parametrize(("messages", "param", "words"), ANTHROPIC_BAD)
def test_anthropic_conversation_rules(http, engine, messages, param, words):
    before = len(engine.submitted)
    for path, extra in (("/v1/messages", {"max_tokens": 8}), ("/v1/messages/count_tokens", {})):
        body = {"model": MODEL, "messages": messages, "tools": A_TOOLS, **extra}
        resp = http.post(path, json=body)
        assert resp.status_code == 400, (path, resp.text)
        err = strict(resp.content, AnthropicErrorResponse).error
        assert err.type == "invalid_request_error", path
        assert err.message.startswith(f"{param}: ") and words in err.message, (path, err.message)
    assert len(engine.submitted) == before  # refused before the engine
    # Allowed: results first then text, and an empty final assistant message (prefill).
    ok = [Q, _use("t1", "t2"), {"role": "user", "content": [
        _result("t1"), _result("t2"), {"type": "text", "text": "thanks"}]},
        {"role": "assistant", "content": ""}]  # fmt: skip
    resp = http.post("/v1/messages", json={"model": MODEL, "max_tokens": 8, "messages": ok})
    assert resp.status_code == 200, resp.text
    assert len(engine.submitted) == before + 1
    ok[-1] = {"role": "assistant", "content": []}
    resp = http.post("/v1/messages", json={"model": MODEL, "max_tokens": 8, "messages": ok})
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize(("fields", "words"), [
    ({"tools": A_TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "'nope'"),
    ({"tool_choice": {"type": "any"}}, "`tools` must be set"),
])  # fmt: skip
def test_count_tokens_checks_tool_choice_as_messages_does(http, fields, words):
    for path, extra in (("/v1/messages", {"max_tokens": 8}), ("/v1/messages/count_tokens", {})):
        resp = http.post(path, json={"model": MODEL, "messages": [Q], **fields, **extra})
        assert resp.status_code == 400, (path, resp.text)
        err = strict(resp.content, AnthropicErrorResponse).error
        assert err.type == "invalid_request_error" and words in err.message, (path, err.message)
    # auto without tools means no tools, on both routes (the fake tokenizer's template
    # takes no tools, so a count with tools is not asked for here).
    resp = http.post("/v1/messages/count_tokens", json={
        "model": MODEL, "messages": [Q], "tool_choice": {"type": "auto"}})  # fmt: skip
    assert resp.status_code == 200 and resp.json()["input_tokens"] > 0, resp.text


def _call(call_id: str) -> dict:
    return {"type": "function_call", "call_id": call_id, "name": "get_weather",
            "arguments": '{"city": "Paris"}'}  # fmt: skip


@pytest.mark.parametrize(("items", "param", "words"), [
    ([_call("c1"), _call("c1"), {"type": "function_call_output", "call_id": "c1",
                                 "output": "sunny"}],
     "input[1].call_id", "repeats call_id 'c1'"),
    ([_call("c1"), {"type": "function_call_output", "output": "sunny"}],
     "input[1].call_id", "needs call_id"),
    ([_call("c1"), {"type": "function_call_output", "call_id": "", "output": "sunny"}],
     "input[1].call_id", "needs call_id"),
])  # fmt: skip
def test_responses_call_ids(http, engine, items, param, words):
    before = len(engine.submitted)
    resp = http.post("/v1/responses", json={"model": MODEL, "input": items, "tools": R_TOOLS})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert words in err["message"], err["message"]
    assert len(engine.submitted) == before
    # Two calls with their own ids, each answered: served.
    ok = [_call("c1"), _call("c2"),
          {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
          {"type": "function_call_output", "call_id": "c2", "output": "rain"}]  # fmt: skip
    resp = http.post("/v1/responses", json={"model": MODEL, "input": ok, "tools": R_TOOLS,
                                            "tool_choice": "none", "max_output_tokens": 4})  # fmt: skip
    assert resp.status_code == 200, resp.text
    assert len(engine.submitted) == before + 1
