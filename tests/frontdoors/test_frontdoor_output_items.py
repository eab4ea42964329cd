"""The output builders of the two front doors (pure logic): parsed deltas become
Responses output items / Anthropic content blocks in the order the model wrote them,
with the exact event sequence; the items a stream builds are the whole answer's."""

from __future__ import annotations

from flowengine.entrypoints.openai.anthropic_output import MessageContent, call_input
from flowengine.entrypoints.openai.chat_adapter import Delta
from flowengine.entrypoints.openai.responses_output import ResponseOutput, call_ids
from flowengine.entrypoints.openai.tool_parsers import ToolCallDelta

TAIL = "0123456789abcdef"
# Reasoning, text, a call that starts mid-delta, its last fragment and more text in the
# next delta (the call's fragment comes first), then a second call.
DELTAS = [
    Delta("", [1], None, reasoning="think"),
    Delta("hi", [2], None, tool_calls=[ToolCallDelta(0, f"chatcmpl-tool-{TAIL}", "f", '{"a"')]),
    Delta(" after", [3], None, tool_calls=[ToolCallDelta(0, None, None, ": 1}")]),
    Delta("", [4], None, tool_calls=[ToolCallDelta(1, "chatcmpl-tool-2", "g", "")]),
]


def test_responses_items_and_events_in_order():
    out = ResponseOutput(plain=False, message_id="msg_1")
    events = out.start()
    for d in DELTAS:
        events += out.feed(d, [])
    events += out.finish("incomplete")
    assert [(t, f.get("output_index")) for t, f in events] == [
        ("response.output_item.added", 0), ("response.content_part.added", 0),
        ("response.reasoning_text.delta", 0), ("response.reasoning_text.done", 0),
        ("response.content_part.done", 0), ("response.output_item.done", 0),
        ("response.output_item.added", 1), ("response.content_part.added", 1),
        ("response.output_text.delta", 1), ("response.output_text.done", 1),
        ("response.content_part.done", 1), ("response.output_item.done", 1),
        ("response.output_item.added", 2), ("response.function_call_arguments.delta", 2),
        ("response.function_call_arguments.delta", 2),
        ("response.function_call_arguments.done", 2), ("response.output_item.done", 2),
        ("response.output_item.added", 3), ("response.content_part.added", 3),
        ("response.output_text.delta", 3), ("response.output_text.done", 3),
        ("response.content_part.done", 3), ("response.output_item.done", 3),
        ("response.output_item.added", 4), ("response.function_call_arguments.done", 4),
        ("response.output_item.done", 4),
    ]  # fmt: skip
    assert out.final == [f["item"] for t, f in events if t == "response.output_item.done"]
    reasoning, first, call, second, call2 = out.final
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "think"}]
    assert reasoning["id"].startswith("rs_") and reasoning["summary"] == []
    assert (first["id"], first["content"][0]["text"]) == ("msg_1", "hi")
    assert second["content"][0]["text"] == " after" and second["id"].startswith("msg_")
    assert second["id"] != "msg_1"
    assert call == {"id": f"fc_{TAIL}", "type": "function_call", "call_id": f"call_{TAIL}",
                    "name": "f", "arguments": '{"a": 1}', "status": "completed"}  # fmt: skip
    assert (call2["name"], call2["arguments"], call2["status"]) == ("g", "", "incomplete")
    assert [i["status"] for i in out.final[:4]] == ["completed"] * 4
    assert call_ids("chatcmpl-tool-x9") == ("fc_x9", "call_x9")


def test_responses_logprobs_travel_with_text_and_empty_outputs():
    out = ResponseOutput(plain=False)
    a, b, c = {"token": "a"}, {"token": "b"}, {"token": "c"}
    events = out.feed(Delta("", [1], None, reasoning="r"), [a])
    events += out.feed(Delta("x", [2], None), [b])
    events += out.feed(Delta("", [3], None, reasoning=""), [c])  # held back text's token
    events += out.finish("completed")
    deltas = [f["logprobs"] for t, f in events if t == "response.output_text.delta"]
    assert deltas == [[a, b], [c]]  # the last tokens in a final empty delta
    assert out.final[1]["content"][0]["logprobs"] == [a, b, c]
    empty = ResponseOutput(plain=False)
    empty.finish("completed")
    assert [(i["type"], i["content"][0]["text"]) for i in empty.final] == [("message", "")]
    plain = ResponseOutput(plain=True, message_id="msg_p")
    assert [t for t, _ in plain.start()] == [
        "response.output_item.added",
        "response.content_part.added",
    ]


def test_anthropic_blocks_and_events_in_order():
    content = MessageContent(plain=False)
    events = content.start()
    for d in DELTAS:
        events += content.feed(d)
    events += content.finish()
    assert [(t, f["index"], f.get("delta", f.get("content_block", {})).get("type"))
            for t, f in events] == [
        ("content_block_start", 0, "thinking"), ("content_block_delta", 0, "thinking_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, "text"), ("content_block_delta", 1, "text_delta"),
        ("content_block_stop", 1, None),
        ("content_block_start", 2, "tool_use"), ("content_block_delta", 2, "input_json_delta"),
        ("content_block_delta", 2, "input_json_delta"), ("content_block_stop", 2, None),
        ("content_block_start", 3, "text"), ("content_block_delta", 3, "text_delta"),
        ("content_block_stop", 3, None),
        ("content_block_start", 4, "tool_use"), ("content_block_stop", 4, None),
    ]  # fmt: skip
    assert content.json() == [
        {"type": "thinking", "thinking": "think", "signature": ""},
        {"type": "text", "text": "hi"},
        {"type": "tool_use", "id": f"toolu_{TAIL}", "name": "f", "input": {"a": 1}},
        {"type": "text", "text": " after"},
        {"type": "tool_use", "id": "toolu_2", "name": "g", "input": {}},
    ]
    assert content.num_tool_uses == 2
    assert call_input('{"city": "Pa') == {} and call_input("[1]") == {}
    empty = MessageContent(plain=False)
    assert [t for t, _ in empty.finish()] == ["content_block_start", "content_block_stop"]
    assert empty.json() == [{"type": "text", "text": ""}]
