"""Tools and thinking on POST /v1/messages through the official `anthropic` SDK, against a
live server with `--tool-call-parser hermes --enable-auto-tool-choice
--reasoning-parser qwen3` on a scripted model (exact outputs): content blocks equal the
chat route's split, streamed input_json_delta fragments join to the non-streamed
input, tool_result turns, tool_choice, bad tool specs in Anthropic's error shape."""

from __future__ import annotations

import json

import anthropic
import pytest
from frontdoor_helpers import (
    EXPECTED,
    MODEL,
    SCRIPTS,
    TIME_SCHEMA,
    WEATHER_SCHEMA,
    make_scripted_engine,
    typed_events,
)
from openai_helpers import strict

from flowengine.entrypoints.openai.chat_parsing import ChatParsingOptions
from flowengine.entrypoints.openai.protocol_anthropic import (
    AnthropicErrorResponse,
    MessageResponse,
)

CHAT_PARSING = ChatParsingOptions(
    tool_call_parser="hermes", enable_auto_tool_choice=True, reasoning_parser="qwen3"
)
make_engine = make_scripted_engine

TOOLS = [
    {"name": "get_weather", "description": "Weather of a city", "input_schema": WEATHER_SCHEMA},
    {"name": "get_time", "input_schema": TIME_SCHEMA},
]
CHAT_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                      "parameters": WEATHER_SCHEMA}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME_SCHEMA}},
]  # fmt: skip


def split(content: list) -> tuple[str | None, str | None, list[tuple[str, dict]]]:
    """(thinking, text, [(name, input)]) of Anthropic content blocks (models or dicts)."""
    blocks = [b if isinstance(b, dict) else b.model_dump() for b in content]
    thinking = "".join(b["thinking"] for b in blocks if b["type"] == "thinking")
    text = "".join(b["text"] for b in blocks if b["type"] == "text")
    calls = [(b["name"], b["input"]) for b in blocks if b["type"] == "tool_use"]
    return thinking or None, text or None, calls


def expected_split(prompt: str) -> tuple:
    reasoning, content, calls = EXPECTED[prompt]
    return reasoning, content, [(name, json.loads(args)) for name, args in calls]


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.mark.parametrize("prompt", sorted(EXPECTED))
def test_blocks_equal_the_chat_route_streamed_and_not(claude, oai, http, prompt):
    chat = oai.chat.completions.create(model=MODEL, messages=user(prompt), tools=CHAT_TOOLS)
    m = chat.choices[0].message
    assert ((m.model_extra or {}).get("reasoning_content"), m.content,
            [(c.function.name, c.function.arguments) for c in m.tool_calls or []]) == (
        EXPECTED[prompt])  # fmt: skip
    expected = expected_split(prompt)
    msg = claude.messages.create(model=MODEL, max_tokens=200, messages=user(prompt), tools=TOOLS)
    assert split(msg.content) == expected
    kinds = [b.type for b in msg.content]
    assert kinds == (["thinking"] if expected[0] else []) + (["text"] if expected[1] else []) + [
        "tool_use"
    ] * len(expected[2])
    assert msg.stop_reason == ("tool_use" if expected[2] else "end_turn")
    ids = [b.id for b in msg.content if b.type == "tool_use"]
    assert all(i.startswith("toolu_") for i in ids) and len(set(ids)) == len(ids)
    assert all(b.signature == "" for b in msg.content if b.type == "thinking")
    body = {"model": MODEL, "max_tokens": 200, "messages": user(prompt), "tools": TOOLS}
    raw = http.post("/v1/messages", json=body)
    strict(raw.content, MessageResponse)
    assert split(raw.json()["content"]) == expected
    # Streamed: blocks start, take their deltas and stop in order; fragments join.
    events = typed_events(http.post("/v1/messages", json={**body, "stream": True}).content)
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == [
        "message_delta",
        "message_stop",
    ]
    blocks: list[dict] = []
    for name, data in events[2:-2]:
        if name == "content_block_start":
            assert data["index"] == len(blocks)
            blocks.append(dict(data["content_block"]))
            continue
        block = blocks[data["index"]]
        assert data["index"] == len(blocks) - 1  # only the open block gets deltas
        if name == "content_block_stop":
            if block["type"] == "tool_use":
                block["input"] = json.loads(block.pop("json", "") or "{}")
            continue
        delta = data["delta"]
        if delta["type"] == "text_delta":
            block["text"] += delta["text"]
        elif delta["type"] == "thinking_delta":
            block["thinking"] += delta["thinking"]
        else:
            assert delta["type"] == "input_json_delta" and block["input"] == {}
            block["json"] = block.get("json", "") + delta["partial_json"]
    assert split(blocks) == expected
    assert [b["type"] for b in blocks] == kinds
    assert events[-2][1]["delta"]["stop_reason"] == msg.stop_reason
    # The SDK's stream helper accumulates the same message (it parses the JSON fragments).
    with claude.messages.stream(model=MODEL, max_tokens=200, messages=user(prompt),
                                tools=TOOLS) as stream:  # fmt: skip
        final = stream.get_final_message()
    assert split(final.content) == expected and final.stop_reason == msg.stop_reason


def test_tool_result_turn(claude, engine):
    first = claude.messages.create(model=MODEL, max_tokens=200, messages=user("one call"),
                                   tools=TOOLS)  # fmt: skip
    call = first.content[-1]
    assert call.type == "tool_use" and call.input == {"city": "Paris"}
    second = claude.messages.create(model=MODEL, max_tokens=200, tools=TOOLS, messages=[
        *user("one call"),
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call.id,
             "content": [{"type": "text", "text": "sunny"}]}]},
    ])  # fmt: skip
    assert split(second.content) == (None, "It is sunny in Paris.", [])
    assert second.stop_reason == "end_turn"
    prompt = engine.submitted[-1][1]
    assert prompt["tools"] == CHAT_TOOLS
    assert prompt["messages"] == [
        {"role": "user", "content": "one call"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]  # fmt: skip
    # Results and text in one user message: the tool message first, thinking dropped.
    claude.messages.create(model=MODEL, max_tokens=5, tools=TOOLS, messages=[
        *user("x"),
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hm", "signature": ""},
            {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "noon"},
            {"type": "text", "text": "and now?"}]},
    ])  # fmt: skip
    assert engine.submitted[-1][1]["messages"][1:] == [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "noon"},
        {"role": "user", "content": "and now?"},
    ]  # fmt: skip


def test_tool_choice(claude, engine):
    m = claude.messages.create(
        model=MODEL, max_tokens=200, messages=user("two calls"), tools=TOOLS,
        tool_choice={"type": "auto", "disable_parallel_tool_use": True},
    )  # fmt: skip
    assert split(m.content)[2] == [("get_weather", {"city": "Paris"})]
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_time"}):
        claude.messages.create(model=MODEL, max_tokens=200, messages=user("one call"),
                               tools=TOOLS, tool_choice=choice)  # fmt: skip
        assert engine.submitted[-1][2].structured_outputs.kind == "structural_tag"
    m = claude.messages.create(model=MODEL, max_tokens=200, messages=user("one call"),
                               tools=TOOLS, tool_choice={"type": "none"})  # fmt: skip
    assert split(m.content) == (None, SCRIPTS["one call"], []) and m.stop_reason == "end_turn"
    # Thinking is served here (a reasoning parser runs); budget_tokens is not enforced
    # on the output (its rules are checked: test_thinking_budget_follows_anthropics_rule).
    m = claude.messages.create(model=MODEL, max_tokens=2000, messages=user("think"),
                               thinking={"type": "enabled", "budget_tokens": 1024})  # fmt: skip
    assert split(m.content) == expected_split("think")


BAD = [
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
    ({"tools": [{"name": "f", "input_schema": {"type": "string"}}]}, "tools[0].input_schema"),
    ({"tools": [{"name": "bad name", "input_schema": {}}]}, "tools[0].name"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "'nope'"),
    ({"tool_choice": {"type": "any"}}, "tools"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]}]}, "toolu_x"),
    ({"messages": [*user("x"), {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]},
        {"role": "user", "content": "no result"}]}, "toolu_1"),
    ({"messages": [*user("x"), {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]}]}, "toolu_1"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]}, "assistant"),
    ({"messages": [*user("x"), {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]}]}]}, "image"),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "words"), BAD)
def test_bad_tool_specs_are_anthropic_400s(http, fields, words):
    body = {"model": MODEL, "max_tokens": 20, "messages": user("one call"), **fields}
    # count_tokens checks the conversation the same way (tool specs too, but the fake
    # tokenizer's template takes no tools, so only the conversation cases say so here).
    paths = ["/v1/messages"] + (["/v1/messages/count_tokens"] if "messages" in fields else [])
    for path in paths:
        resp = http.post(path, json=body)
        assert resp.status_code == 400, (path, resp.text)
        err = strict(resp.content, AnthropicErrorResponse)
        assert err.error.type == "invalid_request_error" and words in err.error.message, path
    ok = http.post("/v1/messages", json={"model": MODEL, "max_tokens": 50,
                                         "messages": user("no call"), "tools": TOOLS})  # fmt: skip
    assert ok.status_code == 200 and ok.json()["content"][0]["text"] == SCRIPTS["no call"]


def test_sdk_error_classes(claude):
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model=MODEL, max_tokens=5, messages=user("x"),
                               tools=[{"name": "f", "input_schema": {"type": "array"}}])  # fmt: skip
    assert err.value.body["error"]["type"] == "invalid_request_error"
    assert "tools[0].input_schema" in err.value.message
    # count_tokens checks the tools as /v1/messages does.
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.count_tokens(model=MODEL, messages=user("x"),
                                     tools=[{"name": "f", "input_schema": {"type": "array"}}])  # fmt: skip
    assert "tools[0].input_schema" in err.value.message


@pytest.mark.parametrize(("thinking", "max_tokens", "words"), [
    ({"type": "enabled", "budget_tokens": -5}, 2000, "at least 1024"),
    ({"type": "enabled", "budget_tokens": 0}, 2000, "at least 1024"),
    ({"type": "enabled", "budget_tokens": 1023}, 2000, "at least 1024"),
    ({"type": "enabled"}, 2000, "needs budget_tokens"),
    ({"type": "enabled", "budget_tokens": 2000}, 2000, "less than max_tokens"),
])  # fmt: skip
def test_thinking_budget_follows_anthropics_rule(http, engine, thinking, max_tokens, words):
    """Anthropic's API reference: budget_tokens ">=1024 and less than max_tokens"
    (required with enabled thinking); the budget is not enforced on the output, but a
    request Anthropic refuses is a 400 naming the field here too."""
    before = len(engine.submitted)
    body = {"model": MODEL, "max_tokens": max_tokens, "messages": user("think"),
            "thinking": thinking}  # fmt: skip
    resp = http.post("/v1/messages", json=body)
    assert resp.status_code == 400, resp.text
    err = strict(resp.content, AnthropicErrorResponse).error
    assert err.type == "invalid_request_error"
    assert err.message.startswith("thinking.budget_tokens: ") and words in err.message
    # count_tokens has no max_tokens: only the budget's own rules apply there.
    del body["max_tokens"]
    resp = http.post("/v1/messages/count_tokens", json=body)
    assert resp.status_code == (200 if words == "less than max_tokens" else 400), resp.text
    assert len(engine.submitted) == before
    # A budget of 1024 under max_tokens, and disabled thinking (no budget): served.
    for thinking in ({"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"}):
        ok = {**body, "max_tokens": 1025, "thinking": thinking}
        assert http.post("/v1/messages", json=ok).status_code == 200
