"""Helpers of the front-door tests: the fake engine's chat template, the typed SSE
framing both APIs use (`event: <type>` + `data: <json>`), and the scripted model of the
tool tests."""

from __future__ import annotations

from typing import Any

import orjson

MODEL = "fake-model"  # the conftest's server serves it and an "alias"


def rendered(messages: list[dict[str, str]]) -> str:
    """The fake engine's chat template: what its greedy output echoes."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def typed_events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of each SSE event; checks the `event:` + `data:` framing, the
    name equal to the data's `type`, and no `data: [DONE]`."""
    assert raw.endswith(b"\n\n") and b"[DONE]" not in raw
    events = []
    for block in raw.split(b"\n\n")[:-1]:
        head, data = block.split(b"\n")
        assert head.startswith(b"event: ") and data.startswith(b"data: "), block
        payload = orjson.loads(data[len(b"data: ") :])
        assert payload["type"] == head[len(b"event: ") :].decode()
        events.append((payload["type"], payload))
    return events


WEATHER_SCHEMA = {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
}  # fmt: skip
TIME_SCHEMA = {"type": "object", "properties": {"tz": {"type": "string"}}}
# The scripted model's answers (hermes tool calls, qwen3 think blocks), by the last
# user message, or by the last tool result ("tool:" + its content).
SCRIPTS = {
    "one call": 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
                '{"city": "Paris"}}\n</tool_call>',
    "two calls": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                 '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}'
                 "\n</tool_call>",
    "no call": "Paris is sunny today.\n",
    "think then call": '<think>\nThe user wants weather.\n</think>\n\n<tool_call>\n'
                       '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
    "think": "<think>\n2 + 2 is 4.\n</think>\n\nIt is 4.",
    "cut": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',
    "tool:sunny": "It is sunny in Paris.",
}  # fmt: skip
# What the chat route makes of each script: (reasoning, content, [(name, arguments)]).
EXPECTED = {
    "one call": (None, "Let me look.", [("get_weather", '{"city": "Paris"}')]),
    "two calls": (None, None, [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "CET"}')]),
    "no call": (None, "Paris is sunny today.\n", []),
    "think then call": ("\nThe user wants weather.\n", None,
                        [("get_weather", '{"city": "Oslo"}')]),
    "think": ("\n2 + 2 is 4.\n", "\n\nIt is 4.", []),
}  # fmt: skip


def script_key(messages: list[dict[str, Any]]) -> str:
    last = messages[-1]
    if last["role"] == "tool":
        return f"tool:{last['content']}"
    users = [m["content"] for m in messages if m["role"] == "user"]
    return users[-1] if users else ""


def make_scripted_engine() -> Any:
    from scripted_engine import ScriptedEngine

    return ScriptedEngine(SCRIPTS, key=script_key, model_name=MODEL, step_s=0.0005)


def num_reasoning_pieces(script: str) -> int:
    """Tokens (scripted pieces) up to the one that completes `</think>`."""
    from scripted_engine import pieces

    end = script.index("</think>") + len("</think>")
    total = 0
    for i, piece in enumerate(pieces(script)):
        total += len(piece)
        if total >= end:
            return i + 1
    raise AssertionError("no </think> in the script")
