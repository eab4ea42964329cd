"""Tools and reasoning on POST /v1/responses through the official `openai` SDK, against a
live server with `--tool-call-parser hermes --enable-auto-tool-choice
--reasoning-parser qwen3` on a scripted model (exact outputs, cut at every kind of
place): output items equal the chat route's split, streamed arguments join to the
non-streamed ones, multi-turn with function_call_output (input items and
previous_response_id), tool_choice / parallel_tool_calls, bad tool specs as OpenAI 400s.
"""

from __future__ import annotations

import json

import openai
import pytest
from frontdoor_helpers import (
    EXPECTED,
    MODEL,
    SCRIPTS,
    TIME_SCHEMA,
    WEATHER_SCHEMA,
    make_scripted_engine,
    num_reasoning_pieces,
    typed_events,
)
from openai_helpers import assert_error, strict

from flowengine.entrypoints.openai.chat_parsing import ChatParsingOptions
from flowengine.entrypoints.openai.protocol_responses import ResponseObject

CHAT_PARSING = ChatParsingOptions(
    tool_call_parser="hermes", enable_auto_tool_choice=True, reasoning_parser="qwen3"
)
make_engine = make_scripted_engine

TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Weather of a city",
     "parameters": WEATHER_SCHEMA},
    {"type": "function", "name": "get_time", "parameters": TIME_SCHEMA},
]  # fmt: skip
CHAT_TOOLS = [
    {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS
]


def split(output: list) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    """(reasoning, content, [(name, arguments)]) of Responses output items (SDK models
    or dicts), as the chat route's message has them."""
    items = [o if isinstance(o, dict) else o.model_dump() for o in output]
    reasoning = "".join(c["text"] for i in items if i["type"] == "reasoning" for c in i["content"])
    content = "".join(
        c["text"] for i in items if i["type"] == "message" for c in i["content"]
    )  # fmt: skip
    calls = [(i["name"], i["arguments"]) for i in items if i["type"] == "function_call"]
    return reasoning or None, content or None, calls


def chat_split(oai, prompt: str, **fields) -> tuple:
    r = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], tools=CHAT_TOOLS, **fields
    )
    m = r.choices[0].message
    calls = [(c.function.name, c.function.arguments) for c in m.tool_calls or []]
    reasoning = (m.model_extra or {}).get("reasoning_content")
    return (reasoning, m.content, calls), r.choices[0].finish_reason


@pytest.mark.parametrize("prompt", sorted(EXPECTED))
def test_output_items_equal_the_chat_route_streamed_and_not(oai, http, prompt):
    expected, finish = chat_split(oai, prompt)
    assert expected == EXPECTED[prompt]
    r = oai.responses.create(model=MODEL, input=prompt, tools=TOOLS)
    assert split(r.output) == expected
    assert r.status == "completed"
    kinds = [o.type for o in r.output]
    assert kinds == (["reasoning"] if expected[0] else []) + (
        ["message"] if expected[1] else []
    ) + ["function_call"] * len(expected[2])
    for item in r.output:
        assert item.status == "completed"
        if item.type == "function_call":
            assert item.call_id.startswith("call_") and item.id.startswith("fc_")
            json.loads(item.arguments)
    assert len({o.id for o in r.output}) == len(r.output)
    assert r.tools[0].name == "get_weather" and r.tool_choice == "auto"
    if expected[0]:
        assert r.usage.output_tokens_details.reasoning_tokens == num_reasoning_pieces(
            SCRIPTS[prompt]
        )
    # The wire body matches the documented schema exactly.
    raw = http.post("/v1/responses", json={"input": prompt, "tools": TOOLS})
    strict(raw.content, ResponseObject)
    assert split(raw.json()["output"]) == expected
    # Streamed: the typed events build the same items.
    events = typed_events(
        http.post("/v1/responses", json={"input": prompt, "tools": TOOLS, "stream": True}).content
    )
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    final = events[-1][1]["response"]
    assert events[-1][0] == "response.completed" and split(final["output"]) == expected
    added = {d["output_index"]: d["item"] for t, d in events if t == "response.output_item.added"}
    done = {d["output_index"]: d["item"] for t, d in events if t == "response.output_item.done"}
    assert list(done.values()) == final["output"] and sorted(added) == sorted(done)
    for index, item in done.items():
        ev = [d for t, d in events if d.get("output_index") == index]
        assert added[index]["id"] == item["id"] and added[index]["status"] == "in_progress"
        if item["type"] == "function_call":
            assert added[index]["call_id"] == item["call_id"] and added[index]["arguments"] == ""
            deltas = [
                d["delta"] for d in ev if d["type"] == "response.function_call_arguments.delta"
            ]
            assert "".join(deltas) == item["arguments"]
            [args_done] = [d for d in ev if d["type"] == "response.function_call_arguments.done"]
            assert (args_done["arguments"], args_done["name"]) == (item["arguments"], item["name"])
        else:
            kind = "output_text" if item["type"] == "message" else "reasoning_text"
            deltas = [d["delta"] for d in ev if d["type"] == f"response.{kind}.delta"]
            assert "".join(deltas) == item["content"][0]["text"]
            assert [d["type"] for d in ev][:2] == [
                "response.output_item.added",
                "response.content_part.added",
            ]
            assert [d["type"] for d in ev][-3:] == [
                f"response.{kind}.done", "response.content_part.done",
                "response.output_item.done"]  # fmt: skip
    # The SDK's raw stream parses every event, and its accumulating helper agrees.
    sdk_events = list(oai.responses.create(model=MODEL, input=prompt, tools=TOOLS, stream=True))
    assert split(sdk_events[-1].response.output) == expected
    with oai.responses.stream(model=MODEL, input=prompt, tools=TOOLS) as stream:
        for _ in stream:
            pass
        assert split(stream.get_final_response().output) == expected


def test_a_call_cut_by_max_output_tokens_is_incomplete(oai):
    r = oai.responses.create(model=MODEL, input="cut", tools=TOOLS, max_output_tokens=18)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    [item] = r.output
    assert (item.type, item.name, item.status) == ("function_call", "get_weather", "incomplete")
    chat, finish = chat_split(oai, "cut", max_tokens=18)
    assert finish == "length" and chat[2] == [(item.name, item.arguments)]


def test_multi_turn_with_function_call_output(oai, engine):
    first = oai.responses.create(model=MODEL, input="one call", tools=TOOLS)
    call = first.output[-1]
    assert call.type == "function_call"
    turn = [
        {"role": "user", "content": "one call"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": call.call_id, "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
    ]  # fmt: skip
    # Through previous_response_id: the stored turn, then the output.
    output = [{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    second = oai.responses.create(
        model=MODEL, input=output, previous_response_id=first.id, tools=TOOLS
    )
    assert second.output_text == "It is sunny in Paris."
    prompt = engine.submitted[-1][1]
    assert prompt["messages"] == turn and prompt["tools"] == CHAT_TOOLS
    # By hand: the first response's output items sent back whole (reasoning items are
    # accepted and dropped), output as input_text parts.
    items = [
        {"role": "user", "content": "one call"},
        *[o.model_dump(exclude_none=True) for o in first.output],
        {"type": "function_call_output", "call_id": call.call_id,
         "output": [{"type": "input_text", "text": "sunny"}]},
    ]  # fmt: skip
    third = oai.responses.create(model=MODEL, input=items, tools=TOOLS)
    assert engine.submitted[-1][1]["messages"] == turn
    assert third.output_text == second.output_text
    # A reasoning turn sent back: its reasoning item is not rendered.
    thought = oai.responses.create(model=MODEL, input="think then call", tools=TOOLS)
    assert [o.type for o in thought.output] == ["reasoning", "function_call"]
    oai.responses.create(model=MODEL, tools=TOOLS, input=[
        {"role": "user", "content": "think then call"},
        *[o.model_dump(exclude_none=True) for o in thought.output],
        {"type": "function_call_output", "call_id": thought.output[1].call_id,
         "output": "sunny"},
    ])  # fmt: skip
    messages = engine.submitted[-1][1]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    assert messages[1]["content"] == "" and messages[1]["tool_calls"][0]["id"] == (
        thought.output[1].call_id
    )


def test_tool_choice_and_parallel_tool_calls(oai, engine):
    # One call only: the second of "two calls" is dropped (OpenAI's parallel_tool_calls).
    r = oai.responses.create(model=MODEL, input="two calls", tools=TOOLS, parallel_tool_calls=False)
    assert split(r.output)[2] == [("get_weather", '{"city": "Paris"}')]
    assert r.parallel_tool_calls is False
    # required and a named function constrain the output with the tools' JSON schema
    # (after the think block, with the reasoning parser: a structural tag).
    for choice in ("required", {"type": "function", "name": "get_time"}):
        r = oai.responses.create(model=MODEL, input="one call", tools=TOOLS, tool_choice=choice)
        params = engine.submitted[-1][2]
        assert params.structured_outputs is not None
        assert params.structured_outputs.kind == "structural_tag"
        assert (
            r.tool_choice == choice if isinstance(choice, str) else r.tool_choice.name == "get_time"
        )
    # none: the tools reach the template, the output is not parsed for calls.
    r = oai.responses.create(model=MODEL, input="one call", tools=TOOLS, tool_choice="none")
    assert [o.type for o in r.output] == ["message"]
    assert r.output_text == SCRIPTS["one call"]
    assert engine.submitted[-1][1]["tools"] == CHAT_TOOLS


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"tools": [{"type": "function"}]}, "tools[0].name", "function name"),
        ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "array"}}]},
         "tools[0].parameters", "object"),
        ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "object",
                     "properties": 3}}]}, "tools[0].parameters", "JSON Schema"),
        ({"tools": [{"type": "function", "name": "f"}, {"type": "function", "name": "f"}]},
         "tools[1].name", "twice"),
        ({"tools": [{"type": "file_search"}]}, "tools[0].type", "file_search"),
        ({"tools": [{"type": "function", "name": "f"}],
          "tool_choice": {"type": "function", "name": "g"}}, "tool_choice", "'g'"),
        ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "mcp"}},
         "tool_choice", "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice", "tools"),
        ({"tools": [{"type": "function", "name": "f"}], "tool_choice": "any"}, "tool_choice",
         "any"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]},
         "input[0].arguments", "arguments"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"},
                    {"role": "user", "content": "x"}]}, "input[0].arguments", "JSON"),
    ],
)  # fmt: skip
def test_bad_tool_specs_are_openai_400s(http, body, param, words):
    body = {"input": "one call", **body}
    err = assert_error(http.post("/v1/responses", json=body), 400, param=param)
    assert words in err["message"]
    ok = http.post("/v1/responses", json={"input": "no call", "tools": TOOLS})
    assert (
        ok.status_code == 200
        and ok.json()["output"][0]["content"][0]["text"] == (SCRIPTS["no call"])
    )


def test_sdk_bad_request(oai):
    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(model=MODEL, input="x", tools=[
            {"type": "function", "name": "bad name!", "parameters": {}}])  # fmt: skip
    assert err.value.body["param"] == "tools[0].name"
    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(model=MODEL, input=[
            {"type": "function_call_output", "call_id": "call_x", "output": "1"}])  # fmt: skip
    assert err.value.body["param"] == "input[0].call_id"
