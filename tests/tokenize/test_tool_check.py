"""`LLM.chat(tools=)` (through `apply_chat_template`) refuses the tools the server
refuses, with the server's words and field (flowengine/tokenize/tool_check.py)."""

from __future__ import annotations

import msgspec
import pytest

from flowengine.entrypoints.openai.errors import APIError
from flowengine.entrypoints.openai.protocol import ChatCompletionTool
from flowengine.entrypoints.openai.tool_parsers.request import check_tools
from flowengine.tokenize.chat import apply_chat_template, validate_tools
from flowengine.tokenize.tool_check import ToolError

TEMPLATE = "{% for t in tools %}{{ t.function.name }};{% endfor %}{{ messages[0].content }}"
ASK = [{"role": "user", "content": "weather?"}]


def _tool(name: str = "get_weather", **parameters) -> dict:
    fn = {"name": name}
    if parameters:
        fn["parameters"] = parameters["parameters"]
    return {"type": "function", "function": fn}


GOOD = _tool(parameters={"type": "object", "properties": {"city": {"type": "string"}}})


@pytest.mark.parametrize(
    ("tools", "param", "message"),
    [
        ([_tool(parameters={"type": "array", "items": {"type": "string"}})],
         "tools[0].function.parameters",
         "Invalid schema for function 'get_weather': schema must be a JSON Schema of "
         "'type: \"object\"', got 'type: 'array''"),
        ([GOOD, _tool("t2", parameters={"type": "object", "properties": 3})],
         "tools[1].function.parameters",
         "the parameters of function 't2' are not a valid JSON Schema: 3 is not of "
         "type 'object' (at properties)"),
        ([_tool(parameters={"$schema": 5})], "tools[0].function.parameters",
         "the parameters of function 'get_weather' are not a valid JSON Schema: $schema "
         "must be a URI string"),
        ([_tool("get weather")], "tools[0].function.name",
         "function name 'get weather' must be 1 to 64 letters, digits, underscores or "
         "dashes"),
        ([_tool("x" * 65)], "tools[0].function.name",
         f"function name {'x' * 65!r} must be 1 to 64 letters, digits, underscores or "
         "dashes"),
        ([GOOD, GOOD], "tools[1].function.name",
         "function 'get_weather' is defined twice; tool names must be unique"),
    ],
)
def test_offline_tools_are_checked_as_the_server_checks_them(
        byte_bpe_tokenizer, tools, param, message):
    with pytest.raises(APIError) as server:
        check_tools(msgspec.convert(tools, list[ChatCompletionTool]))
    assert (server.value.status, server.value.param, server.value.message) == (
        400, param, message)
    with pytest.raises(ToolError) as offline:
        apply_chat_template(byte_bpe_tokenizer, ASK, chat_template=TEMPLATE, tools=tools)
    assert (offline.value.param, str(offline.value)) == (param, message)
    assert isinstance(offline.value, ValueError)  # LLM.chat's documented error


def test_good_tools_render_and_keep_their_shape(byte_bpe_tokenizer):
    second = {"type": "function", "function": {"name": "now"}}  # no parameters: fine
    assert validate_tools([GOOD, second]) == [GOOD, second]
    ids = apply_chat_template(byte_bpe_tokenizer, ASK, chat_template=TEMPLATE,
                              tools=[GOOD, second])
    assert byte_bpe_tokenizer.decode(ids) == "get_weather;now;weather?"


@pytest.mark.parametrize("tool", [{"type": "file_search"}, {"function": "f"}, "f",
                                  {"type": "code", "function": {"name": "f"}}])
def test_not_a_function_tool(tool):
    with pytest.raises(ToolError, match=r"tools\[0\] must be") as err:
        validate_tools([tool])
    assert err.value.param == "tools[0]"


def test_parameters_not_a_dict():
    # The server's request struct refuses this shape before check_tools (a 400 naming
    # the field); offline the same check says so.
    with pytest.raises(ToolError) as err:
        validate_tools([_tool(parameters=[1, 2])])
    assert (err.value.param, str(err.value)) == (
        "tools[0].function.parameters",
        "the parameters of function 'get_weather' must be a JSON Schema object, got list")
