"""Tool-call parsers on hand-written model outputs, one group per format: the exact
message (content, names, argument text), malformed output as plain content, and the
streamed deltas joining to the non-streamed message however the text is cut."""

from __future__ import annotations

import json
import random

import pytest

from flowengine.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    NamedToolParser,
    RequiredToolParser,
    ToolCallDelta,
    get_tool_parser,
    join_deltas,
)

HERMES = TOOL_PARSERS["hermes"]
LLAMA3 = TOOL_PARSERS["llama3_json"]
MISTRAL = TOOL_PARSERS["mistral"]
PYTHONIC = TOOL_PARSERS["pythonic"]


def calls(result) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in result.tool_calls]


def streamed(cls, text: str, *args, rng: random.Random, max_piece: int = 7):
    """Feed `text` in random pieces; return (joined message, every delta)."""
    parser = cls(*args)
    deltas = []
    i = 0
    while i < len(text):
        k = rng.randint(1, max_piece)
        deltas.append(parser.feed(text[i : i + k]))
        i += k
    deltas.append(parser.finish())
    return join_deltas(deltas), deltas


CASES = [
    # (parser, args, model output, expected content, expected calls)
    (HERMES, (), "Let me check.\n<tool_call>\n"
     '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
     "Let me check.", [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    (HERMES, (), '<tool_call>\n{"name": "a", "arguments": {"x": [1, {"y": "</tool_call>"}]}}\n'
     '</tool_call>\n<tool_call>\n{"arguments": {"q": "two"}, "name": "b"}\n</tool_call>',
     None, [("a", '{"x": [1, {"y": "</tool_call>"}]}'), ("b", '{"q": "two"}')]),
    (HERMES, (), '<tool_call>{"name": "now"}</tool_call>', None, [("now", "{}")]),
    (HERMES, (), '<tool_call>{"name": "s", "arguments": "{\\"k\\": 1}"}</tool_call>',
     None, [("s", '{"k": 1}')]),
    (HERMES, (), "No tools needed.\n\nParis is in France.\n", "No tools needed.\n\nParis is in "
     "France.\n", []),
    (HERMES, (), '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>\n\nDone: 3 < 4.',
     "\n\nDone: 3 < 4.", [("f", '{"a": 1}')]),
    # malformed: plain content, tags and all
    (HERMES, (), "<tool_call>I will call get_weather now</tool_call> ok",
     "<tool_call>I will call get_weather now</tool_call> ok", []),
    (HERMES, (), '<tool_call>{"arguments": {"a": 1}}</tool_call>',
     '<tool_call>{"arguments": {"a": 1}}</tool_call>', []),
    (HERMES, (), '<tool_call>{"name": 7, "arguments": {}}</tool_call>',
     '<tool_call>{"name": 7, "arguments": {}}</tool_call>', []),
    (HERMES, (), 'x <tool_call>{"na', "x <tool_call>{\"na", []),
    # a call cut by max_tokens ends where it was cut
    (HERMES, (), 'x <tool_call>{"name": "f", "arguments": {"city": "Par',
     "x", [("f", '{"city": "Par')]),
    # broken after the name: the call ends there, the rest of its region is dropped
    (HERMES, (), '<tool_call>{"name": "f", "arguments": {"a": 1}} oops</tool_call>',
     None, [("f", '{"a": 1}')]),
    (LLAMA3, (), '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
     '{"name": "get_time", "parameters": {}}', None,
     [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
    (LLAMA3, (), '<|python_tag|>{"name": "f", "arguments": {"a": true}}', None,
     [("f", '{"a": true}')]),
    (LLAMA3, (), "The answer is {not json}.", "The answer is {not json}.", []),
    (LLAMA3, (), "{not json}", "{not json}", []),
    (MISTRAL, (), 'Sure.[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, '
     '{"name": "g", "arguments": {}}]</s>', "Sure.", [("f", '{"a": 1}'), ("g", "{}")]),
    (MISTRAL, (), '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]now[ARGS]{}',
     None, [("get_weather", '{"city": "Paris"}'), ("now", "{}")]),
    (MISTRAL, (), "[TOOL_CALLS] not a call at all", "[TOOL_CALLS] not a call at all", []),
    (PYTHONIC, (), '[get_weather(city="Paris", days=[1, 2]), get_time(tz=\'CET\')]', None,
     [("get_weather", '{"city": "Paris", "days": [1, 2]}'), ("get_time", '{"tz": "CET"}')]),
    (PYTHONIC, (), '[note(text="""a ) ] "quoted" text""")]', None,
     [("note", '{"text": "a ) ] \\"quoted\\" text"}')]),
    (PYTHONIC, (), "[1] is a citation.", "[1] is a citation.", []),
    (PYTHONIC, (), "[f(x=__import__('os'))]", "[f(x=__import__('os'))]", []),
    (RequiredToolParser, (), '[{"name": "f", "parameters": {"a": 1}}, '
     '{"name": "g", "parameters": {"b": "x"}}]', None, [("f", '{"a": 1}'), ("g", '{"b": "x"}')]),
    (NamedToolParser, ("get_weather",), ' {"city": "Paris"}\n', None,
     [("get_weather", '{"city": "Paris"}')]),
    (NamedToolParser, ("get_weather",), "", None, [("get_weather", "{}")]),
]


@pytest.mark.parametrize(("cls", "args", "text", "content", "expected"), CASES)
def test_extract_exact(cls, args, text, content, expected):
    result = cls.extract(text, *args)
    assert result.content == content
    assert calls(result) == expected
    for call in result.tool_calls:
        if cls is not MISTRAL:
            assert call.id.startswith("chatcmpl-tool-") and len(call.id) == 14 + 32
        else:
            assert len(call.id) == 9 and call.id.isalnum()
    assert len({c.id for c in result.tool_calls}) == len(result.tool_calls)


@pytest.mark.parametrize(("cls", "args", "text", "content", "expected"), CASES)
def test_streamed_deltas_join_to_the_message(cls, args, text, content, expected):
    rng = random.Random()  # fresh cuts every run
    for max_piece in (1, 3, 7, 40):
        for _ in range(15):
            joined, deltas = streamed(cls, text, *args, rng=rng, max_piece=max_piece)
            assert joined.content == content
            assert calls(joined) == expected
            # OpenAI's piece order: a call's first piece has id and name; later ones
            # only arguments, and calls come in index order.
            first_seen: set[int] = set()
            for d in deltas:
                for piece in d.tool_calls:
                    assert isinstance(piece, ToolCallDelta)
                    if piece.index not in first_seen:
                        assert piece.id and piece.name
                        assert piece.index == len(first_seen)
                        first_seen.add(piece.index)
                    else:
                        assert piece.id is None and piece.name is None


def test_arguments_stream_as_they_are_generated():
    parser = HERMES()
    d = parser.feed("Hi <tool_")  # " <tool_" may start a tag: held
    assert (d.content, d.tool_calls) == ("Hi", [])
    d = parser.feed('call>{"name": "get_weather", ')
    assert d.content == ""
    assert [(p.index, p.name, p.arguments) for p in d.tool_calls] == [(0, "get_weather", "")]
    d = parser.feed('"arguments": {"city": "Pa')
    assert [(p.index, p.id, p.arguments) for p in d.tool_calls] == [(0, None, '{"city": "Pa')]
    d = parser.feed('ris"}}\n</tool_call>')
    assert [p.arguments for p in d.tool_calls] == ['ris"}']
    assert not parser.finish()


def test_whitespace_around_calls_is_not_content_but_plain_text_is_exact():
    assert HERMES.extract("  \n").content == "  \n"
    assert HERMES.extract('\n\n<tool_call>{"name": "f"}</tool_call>\n\n').content is None
    message = HERMES.extract('Hi!\n<tool_call>{"name": "f"}</tool_call>\n')
    assert (message.content, calls(message)) == ("Hi!", [("f", "{}")])


def test_argument_text_is_the_models_own():
    text = '<tool_call>{"name":"f","arguments":{"b":2,  "a":"é"}}</tool_call>'
    [call] = HERMES.extract(text).tool_calls
    assert call.arguments == '{"b":2,  "a":"é"}'
    assert json.loads(call.arguments) == {"b": 2, "a": "é"}


def test_registry_names_and_unknown():
    assert sorted(TOOL_PARSERS) == ["hermes", "llama3_json", "mistral", "pythonic"]
    assert get_tool_parser("hermes") is HERMES
    with pytest.raises(ValueError, match="unknown tool call parser 'qwen'.*hermes"):
        get_tool_parser("qwen")
    assert MISTRAL.skip_special_tokens is False and HERMES.skip_special_tokens is None


def test_delta_json_is_openais_shape():
    assert ToolCallDelta(0, "call-1", "f", "").to_json() == {
        "index": 0, "id": "call-1", "type": "function",
        "function": {"name": "f", "arguments": ""},
    }  # fmt: skip
    assert ToolCallDelta(1, arguments='{"a"').to_json() == {
        "index": 1, "function": {"arguments": '{"a"'},
    }  # fmt: skip
