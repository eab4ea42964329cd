"""A chat request's `tools`, `tool_choice` and `parallel_tool_calls`: checks, and the
JSON schema that makes `tool_choice=required` or a named function always parse.

Rules are OpenAI's and vLLM's (vllm/entrypoints/openai/protocol.py,
`check_tool_usage` and `_get_json_schema_from_tool`):
- no `tool_choice` with tools means "auto", without tools "none";
- `tool_choice` other than "none" needs `tools`; a named function must be one of them;
- an empty tools list is no tools with tool_choice none or auto (vLLM accepts it; OpenAI
  refuses `tools: []` outright), and a 400 naming `tools` with "required" or a named
  function, which need a tool to call (it used to be "none": plain text);
- "auto" needs the server's `--enable-auto-tool-choice` and `--tool-call-parser`;
- a tool's `parameters` must be a JSON Schema of an object (OpenAI's rule), checked
  against the JSON Schema meta-schema.
Each violation is an `APIError(400)` naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flowengine.entrypoints.openai.errors import APIError, bad_request
from flowengine.tokenize.tool_check import ToolError, check_function_name, check_parameters


@dataclass(frozen=True)
class ToolChoice:
    """A request's resolved tool choice.

    Attributes:
        mode: "none", "auto", "required" or "named".
        function_name: the named function (mode "named"), else None.
        tools: the tools as the chat template takes them (OpenAI's
            {"type": "function", "function": {...}} dicts), None without tools.
        parallel_tool_calls: more than one call allowed (OpenAI's default true).
    """

    mode: str
    function_name: str | None = None
    tools: list[dict[str, Any]] | None = None
    parallel_tool_calls: bool = True


def check_tools(tools: list[Any]) -> list[dict[str, Any]]:
    """Validate OpenAI's `tools` (already shaped by the request struct) and return them
    as plain dicts for the chat template. Raises APIError(400)."""
    seen: set[str] = set()
    out = []
    for i, tool in enumerate(tools):
        fn = tool.function
        try:  # the same checks as LLM.chat(tools=) (flowengine/tokenize/tool_check.py)
            check_function_name(i, fn.name, seen)
            if fn.parameters is not None:
                check_parameters(i, fn.name, fn.parameters)
        except ToolError as err:
            raise bad_request(str(err), err.param) from None
        function: dict[str, Any] = {"name": fn.name}
        if fn.description is not None:
            function["description"] = fn.description
        function["parameters"] = (
            fn.parameters if fn.parameters is not None else {"type": "object", "properties": {}}
        )
        if fn.strict is not None:
            function["strict"] = fn.strict
        out.append({"type": "function", "function": function})
    return out


def resolve_tool_choice(
    tools: list[Any] | None,
    tool_choice: Any,
    parallel_tool_calls: bool | None,
    *,
    auto_enabled: bool,
) -> ToolChoice:
    """The request's `ToolChoice`. `tool_choice` is None, "none", "auto", "required" or
    a named-function struct (`.function.name`). `auto_enabled`: the server has
    --enable-auto-tool-choice and a --tool-call-parser. Raises APIError(400)."""
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    checked = check_tools(tools) if tools is not None else None
    if tool_choice is None:
        tool_choice = "auto" if checked else "none"
    if tool_choice == "none":
        return ToolChoice("none", tools=checked, parallel_tool_calls=parallel)
    if checked is None:
        raise bad_request("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if not checked:
        if tool_choice == "auto":
            return ToolChoice("none", tools=None, parallel_tool_calls=parallel)
        raise bad_request(
            "tools is an empty array, but tool_choice asks for a tool call; send at "
            "least one tool",
            "tools",
        )
    if tool_choice == "auto":
        if not auto_enabled:
            raise bad_request(
                '"auto" tool choice requires --enable-auto-tool-choice and '
                "--tool-call-parser to be set",
                "tool_choice",
            )
        return ToolChoice("auto", tools=checked, parallel_tool_calls=parallel)
    if tool_choice == "required":
        return ToolChoice("required", tools=checked, parallel_tool_calls=parallel)
    name = tool_choice.function.name
    if name not in {t["function"]["name"] for t in checked}:
        raise bad_request(
            f"tool_choice names the function {name!r}, which is not among the request's "
            f"tools ({', '.join(repr(t['function']['name']) for t in checked) or 'none'})",
            "tool_choice",
        )
    return ToolChoice("named", name, checked, parallel)


def tool_choice_schema(choice: ToolChoice) -> dict[str, Any] | None:
    """The JSON schema the output must follow, or None ("none", "auto").

    Named: that function's parameters. Required: vLLM's array of
    {"name": <one tool's name>, "parameters": <its parameters>} objects (anyOf the
    tools), at least one item, at most one without parallel_tool_calls; `$defs` of the
    tools are merged to the top (the same name with two schemas is a 400), and the
    tools' other local `$ref`s (`#`, `#/definitions/...`, `#/properties/...`) point to
    where their parameters now are.
    """
    if choice.mode == "named":
        assert choice.tools is not None
        [tool] = [t for t in choice.tools if t["function"]["name"] == choice.function_name]
        return tool["function"]["parameters"]
    if choice.mode != "required":
        return None
    assert choice.tools is not None
    defs: dict[str, Any] = {}
    branches = []
    for i, tool in enumerate(choice.tools):
        fn = tool["function"]
        base = f"#/items/anyOf/{i}/properties/parameters"
        parameters = _nest_refs(fn["parameters"], base)  # a copy
        for name, schema in parameters.pop("$defs", {}).items():
            if name in defs and defs[name] != schema:
                raise bad_request(
                    f"tool definition {name!r} ($defs) has two different schemas across the "
                    "tools, which is not supported with tool_choice=required",
                    f"tools[{i}].function.parameters",
                )
            defs[name] = schema
        branches.append({
            "properties": {
                "name": {"type": "string", "enum": [fn["name"]]},
                "parameters": parameters,
            },
            "required": ["name", "parameters"],
        })
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": branches},
    }
    if not choice.parallel_tool_calls:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


# Keywords whose values are instances, not schemas: a "$ref" key inside is data.
_INSTANCE_KEYWORDS = frozenset({"const", "default", "enum", "examples"})


def _nest_refs(schema: Any, base: str) -> Any:
    """`schema` with its local `$ref`s (JSON pointers from its root, `#...`) made
    pointers from the root of the schema it is nested in at `base`; refs into the
    merged `#/$defs/` stay."""
    if isinstance(schema, list):
        return [_nest_refs(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#") \
                and not value.startswith("#/$defs/"):
            out[key] = base + value[1:]
        elif key in _INSTANCE_KEYWORDS:
            out[key] = value
        else:
            out[key] = _nest_refs(value, base)
    return out


__all__ = ["APIError", "ToolChoice", "check_tools", "resolve_tool_choice", "tool_choice_schema"]
