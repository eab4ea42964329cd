"""`tools` / `tool_choice` checks and the JSON schema of required / named tool choice
(tool_parsers/request.py), and the hermes template file rendering tools and tool turns."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import msgspec
import pytest

from flowengine.entrypoints.openai.errors import APIError
from flowengine.entrypoints.openai.protocol import ChatCompletionRequest, ChatCompletionTool
from flowengine.entrypoints.openai.tool_parsers.request import (
    check_tools,
    resolve_tool_choice,
    tool_choice_schema,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
TEMPLATE = Path(__file__).resolve().parents[2] / "examples/templates/tool_chat_template_hermes.jinja"


def _req(**fields) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    return msgspec.json.decode(msgspec.json.encode(body), type=ChatCompletionRequest)


def _resolve(auto_enabled: bool = True, **fields):
    req = _req(**fields)
    return resolve_tool_choice(
        req.tools, req.tool_choice, req.parallel_tool_calls, auto_enabled=auto_enabled
    )


def _error(auto_enabled: bool = True, **fields) -> APIError:
    with pytest.raises(APIError) as info:
        _resolve(auto_enabled, **fields)
    assert info.value.status == 400
    return info.value


def test_defaults_are_openais():
    assert _resolve().mode == "none" and _resolve().tools is None
    choice = _resolve(tools=[WEATHER])
    assert (choice.mode, choice.parallel_tool_calls) == ("auto", True)
    assert choice.tools == [WEATHER]
    # a tool without parameters gets the empty object schema (what templates expect)
    assert _resolve(tools=[TIME]).tools == [{"type": "function", "function": {
        "name": "get_time", "parameters": {"type": "object", "properties": {}}}}]  # fmt: skip
    assert _resolve(tools=[WEATHER], tool_choice="none").mode == "none"
    named = _resolve(tools=[WEATHER, TIME], tool_choice={
        "type": "function", "function": {"name": "get_time"}})  # fmt: skip
    assert (named.mode, named.function_name) == ("named", "get_time")


@pytest.mark.parametrize(
    ("fields", "auto", "param", "text"),
    [
        ({"tool_choice": "required"}, True, "tool_choice", "`tools` must be set"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, True,
         "tool_choice", "`tools` must be set"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         True, "tool_choice", "'nope', which is not among the request's tools ('get_weather')"),
        ({"tools": [WEATHER]}, False, "tool_choice",
         "--enable-auto-tool-choice and --tool-call-parser"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "strin"}}}}}]}, True,
         "tools[0].function.parameters", "not a valid JSON Schema"),
        ({"tools": [TIME, {"type": "function", "function": {"name": "f", "parameters": {
            "type": "array"}}}]}, True, "tools[1].function.parameters",
         "must be a JSON Schema of 'type: \"object\"'"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "required": "a"}}}]}, True, "tools[0].function.parameters", "not a valid JSON Schema"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, True,
         "tools[0].function.name", "letters, digits"),
        ({"tools": [TIME, TIME]}, True, "tools[1].function.name", "defined twice"),
    ],
)
def test_bad_tools_name_the_field(fields, auto, param, text):
    err = _error(auto, **fields)
    assert err.param == param
    assert text in err.message


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "f"}}]
)
def test_empty_tools_refused_where_a_tool_call_is_required(tool_choice):
    """`tools: []` with "required" or a named function is a 400 naming tools (it was
    "none" for required: plain text); with none, auto or no tool_choice it is no tools
    (vLLM accepts it)."""
    choice = _req(tools=[], tool_choice=tool_choice).tool_choice  # decoded
    with pytest.raises(APIError) as info:
        resolve_tool_choice([], choice, None, auto_enabled=True)
    assert (info.value.status, info.value.param) == (400, "tools")
    assert "asks for a tool call" in info.value.message
    for lenient in ("none", "auto", None):
        resolved = resolve_tool_choice([], lenient, None, auto_enabled=True)
        assert resolved.mode == "none" and not resolved.tools


def test_named_schema_is_the_functions_parameters():
    choice = _resolve(tools=[WEATHER], tool_choice={
        "type": "function", "function": {"name": "get_weather"}})  # fmt: skip
    assert tool_choice_schema(choice) == WEATHER["function"]["parameters"]
    assert tool_choice_schema(_resolve(tools=[WEATHER])) is None  # auto: parsed, not forced


def test_required_schema_is_vllms_array():
    choice = _resolve(tools=[WEATHER, TIME], tool_choice="required")
    schema = tool_choice_schema(choice)
    assert schema == {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": ["get_weather"]},
                            "parameters": WEATHER["function"]["parameters"]},
             "required": ["name", "parameters"]},
            {"properties": {"name": {"type": "string", "enum": ["get_time"]},
                            "parameters": {"type": "object", "properties": {}}},
             "required": ["name", "parameters"]},
        ]},
    }  # fmt: skip
    ok = [{"name": "get_weather", "parameters": {"city": "Paris"}},
          {"name": "get_time", "parameters": {}}]  # fmt: skip
    jsonschema.validate(ok, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "parameters": {}}], schema)
    single = tool_choice_schema(
        _resolve(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    )
    assert single["maxItems"] == 1


def test_required_schema_merges_defs():
    ref_tool = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"p": {"$ref": "#/$defs/Point"}},
        "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "number"}}}}}}}
    schema = tool_choice_schema(_resolve(tools=[ref_tool], tool_choice="required"))
    assert schema["$defs"] == {"Point": {"type": "object", "properties": {"x": {"type": "number"}}}}
    assert "$defs" not in schema["items"]["anyOf"][0]["properties"]["parameters"]
    jsonschema.validate([{"name": "add", "parameters": {"p": {"x": 1}}}], schema)
    clash = {"type": "function", "function": {"name": "sub", "parameters": {
        "type": "object", "$defs": {"Point": {"type": "string"}}}}}
    choice = _resolve(tools=[ref_tool, clash], tool_choice="required")
    with pytest.raises(APIError, match="'Point'") as info:
        tool_choice_schema(choice)
    assert info.value.param == "tools[1].function.parameters"


def test_required_schema_keeps_local_refs():
    """Refs other than `#/$defs/` (draft-07's `definitions`, a property, the root) still
    resolve once the parameters sit inside the required array's schema (they pointed
    to its root: a valid tool was a 400, "Cannot find field 'definitions'")."""
    tree = {"type": "function", "function": {"name": "tree", "parameters": {
        "type": "object",
        "properties": {"loc": {"$ref": "#/definitions/Loc"}, "size": {"type": "integer"},
                       "copy": {"$ref": "#/properties/size"}, "child": {"$ref": "#"},
                       "tag": {"enum": [{"$ref": "#/data"}]}},
        "required": ["loc"],
        "definitions": {"Loc": {"type": "string", "enum": ["Paris", "Oslo"]}}}}}
    schema = tool_choice_schema(_resolve(tools=[WEATHER, tree], tool_choice="required"))
    parameters = schema["items"]["anyOf"][1]["properties"]["parameters"]
    base = "#/items/anyOf/1/properties/parameters"
    assert parameters["properties"]["loc"] == {"$ref": base + "/definitions/Loc"}
    assert parameters["properties"]["child"] == {"$ref": base}
    assert parameters["properties"]["tag"] == {"enum": [{"$ref": "#/data"}]}  # data, kept
    assert tree["function"]["parameters"]["properties"]["child"] == {"$ref": "#"}
    ok = [{"name": "tree", "parameters": {"loc": "Oslo", "copy": 2,
                                          "child": {"loc": "Paris"}}}]  # fmt: skip
    jsonschema.validate(ok, schema)
    for bad in ({"loc": "Rome"}, {"loc": "Oslo", "copy": "2"}, {"loc": "Oslo", "child": {}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([{"name": "tree", "parameters": bad}], schema)
    from flowengine.sampling_params import StructuredOutputsParams
    from flowengine.structured_outputs.validate import validate_structured_outputs

    for backend in ("xgrammar", "guidance"):  # both compile it
        validate_structured_outputs(StructuredOutputsParams(json=schema), backend)


def test_meta_schema_check_runs_once_per_distinct_schema(monkeypatch):
    """The meta-schema check (milliseconds a tool, on the server's event loop) is
    remembered by the schema's JSON text: a request's tools are checked by its route and
    again by the chat template, and agents send the same tools every turn (a request
    with a few hundred tools held every other client up for seconds)."""
    from flowengine.tokenize import tool_check

    checked = []
    real = tool_check._schema_problem
    monkeypatch.setattr(tool_check, "_schema_problem",
                        lambda schema: checked.append(schema) or real(schema))
    tool_check._cached_schema_problem.cache_clear()
    renamed = {"type": "function", "function": {**WEATHER["function"], "name": "other"}}
    tz = {"type": "function", "function": {"name": "tz", "parameters": {"type": "object"}}}
    tools = msgspec.convert([WEATHER, tz, renamed, TIME], list[ChatCompletionTool])
    for _ in range(3):
        assert len(check_tools(tools)) == 4
    assert checked == [WEATHER["function"]["parameters"], tz["function"]["parameters"]]
    bad = msgspec.convert([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "nonsense"}}}}}], list[ChatCompletionTool])
    for _ in range(2):  # a remembered problem is the same 400
        with pytest.raises(APIError, match="not a valid JSON Schema: 'nonsense'") as info:
            check_tools(bad)
        assert info.value.param == "tools[0].function.parameters"
    assert len(checked) == 3


def test_hermes_template_renders_tools_calls_and_results(tokenizer):
    from flowengine.tokenize.chat import apply_chat_template, load_chat_template

    template = load_chat_template(str(TEMPLATE))
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "22 C"},
    ]  # fmt: skip
    ids = apply_chat_template(tokenizer, messages, chat_template=template, tools=[WEATHER])
    text = tokenizer.decode(ids)
    assert text.startswith(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face\n\nYou can call functions"
    )
    assert '\n<tools>\n{"name": "get_weather", "description": "Current weather of a city", ' \
        '"parameters": {"type": "object", "properties": {"city": {"type": "string"}, ' \
        '"unit": {"enum": ["c", "f"]}}, "required": ["city"]}}\n</tools>\n' in text
    assert text.endswith(
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n22 C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # Without tools the template is SmolLM2's own conversation format.
    plain = apply_chat_template(tokenizer, messages[:1], chat_template=template)
    assert plain == apply_chat_template(tokenizer, messages[:1])


def test_bad_tool_call_arguments_in_history(tokenizer):
    from flowengine.tokenize.chat import apply_chat_template

    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "",
                 "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{oops"}}]}]
    with pytest.raises(ValueError, match=r"messages\[1\].tool_calls\[0\].function.arguments"):
        apply_chat_template(tokenizer, messages, tools=[WEATHER])
    for arguments in ("[1, 2]", "3", [1, 2]):  # JSON text of a non-object, or not a dict
        messages[1]["tool_calls"][0]["function"]["arguments"] = arguments
        with pytest.raises(ValueError, match=r"\.function\.arguments must be an object"):
            apply_chat_template(tokenizer, messages, tools=[WEATHER])
    with pytest.raises(ValueError, match=r"tools\[0\] must be"):
        apply_chat_template(tokenizer, messages[:1], tools=[{"name": "f"}])
