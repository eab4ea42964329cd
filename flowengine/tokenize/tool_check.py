"""The checks of one OpenAI function tool, shared by the server's `tools` (a 400 naming
the field) and `LLM.chat(tools=)` (a ValueError with the same words).

OpenAI's rules: a function name is 1 to 64 letters, digits, underscores or dashes and
unique in the request; `parameters` is a JSON Schema of an object, valid against the
JSON Schema meta-schema of its `$schema` dialect (Draft 2020-12 by default).

Pure Python (jsonschema, orjson): no server imports, no torch.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import orjson

_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
MAX_NAME_LEN = 64


class ToolError(ValueError):
    """A bad tool; `param` is the field, e.g. "tools[0].function.parameters"."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_function_name(index: int, name: Any, seen: set[str]) -> None:
    """Raise ToolError for a name that breaks OpenAI's rule or is in `seen` (the names
    of the tools before it); adds it to `seen`."""
    field = f"tools[{index}].function.name"
    if (not isinstance(name, str) or not name or len(name) > MAX_NAME_LEN
            or not set(name) <= _NAME_CHARS):
        raise ToolError(
            f"function name {name!r} must be 1 to {MAX_NAME_LEN} letters, digits, "
            "underscores or dashes", field)
    if name in seen:
        raise ToolError(f"function {name!r} is defined twice; tool names must be unique",
                        field)
    seen.add(name)


def check_parameters(index: int, name: str, parameters: Any) -> None:
    """Raise ToolError unless `parameters` is a valid JSON Schema of an object."""
    field = f"tools[{index}].function.parameters"
    if not isinstance(parameters, Mapping):
        raise ToolError(
            f"the parameters of function {name!r} must be a JSON Schema object, got "
            f"{type(parameters).__name__}", field)
    kind = parameters.get("type", "object")
    if kind != "object":
        raise ToolError(
            f"Invalid schema for function {name!r}: schema must be a JSON Schema of "
            f"'type: \"object\"', got 'type: {kind!r}'", field)
    dialect = parameters.get("$schema")
    if dialect is not None and not isinstance(dialect, str):
        raise ToolError(
            f"the parameters of function {name!r} are not a valid JSON Schema: $schema "
            "must be a URI string", field)
    try:
        text = orjson.dumps(parameters)
    except orjson.JSONEncodeError:  # not JSON data (offline tools), or nested too deeply
        problem = _schema_problem(parameters)
    else:
        problem = _cached_schema_problem(text)
    if problem == _TOO_DEEP:
        raise ToolError(f"the parameters of function {name!r} nest too deeply", field)
    if problem is not None:
        raise ToolError(
            f"the parameters of function {name!r} are not a valid JSON Schema: {problem}",
            field)


_TOO_DEEP = "nests too deeply"


@functools.lru_cache(maxsize=1024)
def _cached_schema_problem(text: bytes) -> str | None:
    """`_schema_problem` of a schema given as its JSON text, remembered: the meta-schema
    check costs milliseconds a tool on the event loop, agents send the same tools every
    turn, and a server request checks them twice (its route, then the chat template)."""
    return _schema_problem(orjson.loads(text))


def _schema_problem(parameters: Mapping[str, Any]) -> str | None:
    """Why `parameters` breaks the meta-schema of its `$schema` dialect (Draft 2020-12 by
    default), or None if it does not."""
    from jsonschema import exceptions, validators

    cls = validators.validator_for(parameters, default=validators.Draft202012Validator)
    try:
        cls.check_schema(parameters)
    except RecursionError:
        return _TOO_DEEP
    except exceptions.SchemaError as err:
        where = "/".join(str(p) for p in err.path)
        return err.message + (f" (at {where})" if where else "")
    return None
