"""The OpenAPI 3.1 document of the server, generated from the route table.

Schemas come from the msgspec request/response structs through
`msgspec.json.schema_components` (JSON Schema 2020-12, which OpenAPI 3.1 embeds), so
the document cannot drift from what the handlers decode.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

import flowengine
from flowengine.entrypoints.openai.protocol import null_default_fields
from flowengine.entrypoints.openai.responses import ErrorResponse
from flowengine.entrypoints.openai.router import Route

REF_TEMPLATE = "#/components/schemas/{name}"

# Ranges that SamplingParams checks (its messages name the rule, so the structs leave
# them out), stated in the document so that it describes what the server accepts.
SAMPLING_RANGES: dict[str, dict[str, float]] = {
    "top_p": {"exclusiveMinimum": 0.0, "maximum": 1.0},
    "min_p": {"minimum": 0.0, "maximum": 1.0},
    "presence_penalty": {"minimum": -2.0, "maximum": 2.0},
    "frequency_penalty": {"minimum": -2.0, "maximum": 2.0},
    "repetition_penalty": {"exclusiveMinimum": 0.0},
    "top_k": {"minimum": -1},
}
GENERATION_REQUESTS = (
    "CompletionRequest", "ChatCompletionRequest", "ResponsesRequest", "MessagesRequest",
    "CountTokensRequest",
)  # fmt: skip
_NULL = {"type": "null"}
# Fields the structs declare (so the handlers can name them in a 400) but that only
# accept their "off" value: the document says so.
REFUSED_VALUES: dict[str, dict[str, Any]] = {
    "suffix": {"anyOf": [_NULL, {"type": "string", "maxLength": 0}], "default": None},
    "functions": {"anyOf": [_NULL, {"type": "array", "maxItems": 0}], "default": None},
    # Not refused, but narrower than its type: token-id keys, biases in [-100, 100].
    "logit_bias": {"anyOf": [_NULL, {
        "type": "object",
        "propertyNames": {"pattern": "^(0|[1-9][0-9]*)$"},
        "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
    }], "default": None},
}
# Per request struct: fields that accept fewer values than their type (the handler
# answers 400 to the others), stated exactly so the document describes what is served.
REFUSED_BY_REQUEST: dict[str, dict[str, dict[str, Any]]] = {
    "ResponsesRequest": {
        "background": {"anyOf": [_NULL, {"const": False}], "default": None},
        "include": {"anyOf": [_NULL, {
            "type": "array", "items": {"const": "message.output_text.logprobs"},
        }], "default": None},
        "truncation": {"anyOf": [_NULL, {"const": "disabled"}], "default": None},
    },
    "MessagesRequest": {},
}  # fmt: skip
REFUSED_BY_REQUEST["CountTokensRequest"] = REFUSED_BY_REQUEST["MessagesRequest"]
# Component schemas of text-only content, by struct name: the `type` values served.
TEXT_ONLY_PARTS = {
    "TextPart": ("text",),
    "ToolResultPart": ("text",),
    "InputContentPart": ("input_text", "output_text"),
}


def _sse_schema(data: str, description: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "data": {"type": "string", "description": data},
            "event": {"type": "string"},
        },
        "required": ["data"],
        "description": description,
    }


# The events of each streaming route (one schema per event; see the handlers).
STREAM_EVENTS = {
    # The OpenAI chunk routes: a chunk's JSON, an error object's JSON, or "[DONE]" last.
    "chunks": _sse_schema(
        "a chunk's JSON, or OpenAI's error object's JSON if the stream failed; the last "
        "event's data is [DONE]",
        "`data: <chunk JSON>` events, then `data: [DONE]`",
    ),
    "/v1/responses": _sse_schema(
        "the JSON of a typed Responses event (its `type` also in `event`, with a "
        "`sequence_number`)",
        "response.created ... response.completed (or response.incomplete, response.failed)",
    ),
    "/v1/messages": _sse_schema(
        "the JSON of an Anthropic event (its `type` also in `event`), or Anthropic's "
        "error object in an `error` event",
        "message_start ... message_stop",
    ),
}
# Message content parts: only text parts are served.
TEXT_PART = {
    "title": "TextPart",
    "type": "object",
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    "required": ["type", "text"],
}


def _constrain(prop: dict[str, Any], rules: dict[str, float]) -> None:
    """Add `rules` to a property's numeric schema (also inside `anyOf` with null)."""
    for branch in prop.get("anyOf", [prop]):
        if branch.get("type") in ("number", "integer"):
            branch.update(rules)


def _or_null(prop: dict[str, Any]) -> dict[str, Any]:
    """`prop` also accepting null (its default kept at the top)."""
    branches = prop.get("anyOf", [prop])
    if any(b.get("type") == "null" for b in branches):
        return prop
    schema = {k: v for k, v in prop.items() if k != "default"}
    out: dict[str, Any] = {"anyOf": [schema, _NULL]}
    if "default" in prop:
        out["default"] = prop["default"]
    return out


def build_openapi(
    routes: Sequence[Route],
    *,
    has_api_key: bool,
    root_path: str = "",
    max_n: int | None = None,
    max_logprobs: int | None = None,
) -> dict[str, Any]:
    """An OpenAPI 3.1 document describing every route (`HEAD`, which every `GET`
    route also answers, and `OPTIONS` are left implicit)."""
    types: list[Any] = [ErrorResponse]
    for route in routes:
        types += [*route.request_types, *([route.response_type] if route.response_type else [])]
        if route.error_type not in types:
            types.append(route.error_type)
    schemas, components = msgspec.json.schema_components(types, ref_template=REF_TEMPLATE)
    schema_of = dict(zip([id(t) for t in types], schemas, strict=True))
    rules: dict[str, dict[str, float]] = dict(SAMPLING_RANGES)
    if max_n is not None:
        rules["n"] = rules["best_of"] = {"maximum": max_n}
    if max_logprobs is not None and max_logprobs != -1:  # -1: no limit
        rules["logprobs"] = rules["prompt_logprobs"] = {"maximum": max_logprobs}
    for name in GENERATION_REQUESTS:
        props = components.get(name, {}).get("properties", {})
        for field_name, field_rules in rules.items():
            if field_name in props:
                _constrain(props[field_name], field_rules)
        for field_name, schema in {**REFUSED_VALUES, **REFUSED_BY_REQUEST.get(name, {})}.items():
            if field_name in props:
                props[field_name] = schema
    for name, part_types in TEXT_ONLY_PARTS.items():
        if name in components:
            kind = {"const": part_types[0]} if len(part_types) == 1 else {"enum": list(part_types)}
            components[name] = {
                **TEXT_PART,
                "title": name,
                "properties": {**TEXT_PART["properties"], "type": kind},
                "description": components[name].get("description", ""),
            }
    if "InputItem" in components:  # the item types the Responses route serves
        components["InputItem"]["properties"]["type"] = {
            "enum": ["message", "function_call", "function_call_output", "reasoning"],
            "default": "message",
        }
    if "ContentBlock" in components:  # the Anthropic block types served
        components["ContentBlock"]["properties"]["type"] = {
            "enum": ["text", "tool_use", "tool_result", "thinking", "redacted_thinking"],
        }
    if "ResponsesTool" in components:  # function tools only
        components["ResponsesTool"]["properties"]["type"] = {"const": "function"}
    if "AnthropicTool" in components:  # custom tools only
        components["AnthropicTool"]["properties"]["type"] = {
            "anyOf": [_NULL, {"const": "custom"}], "default": None,
        }
    # A request's top-level field sent as null takes its default (ServingContext.decode).
    for route in routes:
        for t in route.request_types:
            if isinstance(t, type) and issubclass(t, msgspec.Struct):
                props = components.get(t.__name__, {}).get("properties", {})
                for name in null_default_fields(t) & props.keys():
                    props[name] = _or_null(props[name])
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        error = {"application/json": {"schema": schema_of[id(route.error_type)]}}
        op: dict[str, Any] = {
            "summary": route.summary,
            "operationId": route.method.lower()
            + route.path.replace("/", "_").replace(".", "_").replace("{", "").replace("}", ""),
            "responses": {"default": {"description": "the error object", "content": error}},
        }
        ok: dict[str, Any] = {"description": "success"}
        if route.response_type is not None:
            ok["content"] = {
                route.response_content_type: {"schema": schema_of[id(route.response_type)]}
            }
        elif route.response_content_type != "application/json":
            ok["content"] = {route.response_content_type: {"schema": {"type": "string"}}}
        if route.streams:
            # One server-sent event (as OpenAPI 3.2's itemSchema describes a stream).
            ok.setdefault("content", {})["text/event-stream"] = {
                "schema": STREAM_EVENTS.get(route.path, STREAM_EVENTS["chunks"])
            }
        op["responses"]["200"] = ok
        if route.request_types:
            bodies = [schema_of[id(t)] for t in route.request_types]
            body = bodies[0] if len(bodies) == 1 else {"oneOf": bodies}
            op["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": body}},
            }
        if route.path_params:
            op["parameters"] = [
                {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
                for name in route.path_params
            ]
        if route.requires_auth and has_api_key:
            op["security"] = [{"bearer": []}]
            if route.accepts_x_api_key:
                op["security"].append({"x_api_key": []})
        paths.setdefault(route.path, {})[route.method.lower()] = op
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "FlowEngine OpenAI-compatible API", "version": flowengine.__version__},
        "paths": paths,
        "components": {"schemas": components},
    }
    if root_path:
        doc["servers"] = [{"url": root_path}]
    if has_api_key:
        doc["components"]["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer"},
            # Anthropic's header, accepted on its routes (Route.accepts_x_api_key).
            "x_api_key": {"type": "apiKey", "in": "header", "name": "x-api-key"},
        }
    return doc
