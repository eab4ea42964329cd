"""OpenAI's error object, and the exceptions the server turns into it.

Every error response, and every error event in an SSE stream, has OpenAI's shape:
`{"error": {"message": str, "type": str, "param": str | None, "code": str | None}}`
(https://platform.openai.com/docs/guides/error-codes). The `type` strings follow the
OpenAI API; the HTTP status carries the class (400, 401, 404, 405, 413, 429, 500, 503).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import msgspec

# msgspec validation messages end with "- at `$.path.to[0].field`"; that path is
# OpenAI's `param`.
_AT_PATH = re.compile(r" - at `\$\.?(?P<param>[^`]*)`$")
_MISSING_FIELD = re.compile(r"^Object missing required field `(?P<param>[^`]+)`")


class APIError(Exception):
    """An error answered to the client as OpenAI's error object.

    Args:
        status: HTTP status code.
        message: what went wrong and what to change; shown to the client verbatim.
        type: OpenAI's error type, e.g. "invalid_request_error".
        param: the request field at fault, if any ("messages[0].role").
        code: a machine-readable code, e.g. "model_not_found".
        retry_after_s: sets the `Retry-After` header (rounded up to whole seconds).
        headers: more response headers (e.g. `Allow` for 405).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})
        if retry_after_s is not None:
            self.headers["retry-after"] = str(max(1, math.ceil(retry_after_s)))

    def body(self) -> dict[str, dict[str, str | None]]:
        """OpenAI's error object for this error."""
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, dict[str, str | None]]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def from_decode_error(err: msgspec.DecodeError, body: bytes = b"") -> APIError:
    """A 400 for a body that is not JSON or does not match the request schema. `body`
    (when given) lets a lone surrogate escape be named: msgspec reports one as
    "Input data was truncated"."""
    message = str(err)
    if not isinstance(err, msgspec.ValidationError):
        if message == "Input data was truncated" and (where := _lone_surrogate_at(body)):
            field = where if where != "the body" and not where.endswith("a key") else None
            return APIError(400, f"{where}: not valid Unicode text (a \\uD800-\\uDFFF escape "
                            "without the other half of its surrogate pair)", param=field,
                            code="invalid_json")
        return APIError(400, f"the request body is not valid JSON: {message}", code="invalid_json")
    param = None
    if m := _AT_PATH.search(message):
        param = m.group("param") or None
    elif m := _MISSING_FIELD.match(message):
        param = m.group("param")
    if param == "add_special_tokens":
        message = (
            "add_special_tokens: only vLLM's default is served yet (true on "
            "/v1/completions, false on chat, whose template writes the special tokens); "
            "remove it or send the default"
        )
    elif param in _unsupported_fields():
        message = (
            f"{param} is not supported yet by this server; remove it (it would change "
            "the output, so it is refused rather than ignored)"
        )
    return APIError(400, message, param=param)


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_SURROGATE_SEARCH_MAX_BYTES = 1 << 20


def _lone_surrogate_at(body: bytes) -> str | None:
    """Where `body` holds a string with a lone UTF-16 surrogate escape (\\ud800 without
    its pair, which msgspec reports as "Input data was truncated" and Python's json
    module accepts): the first such field's path ("messages[0].content"), or None if
    the body is not that case."""
    if len(body) > _SURROGATE_SEARCH_MAX_BYTES or not _SURROGATE_ESCAPE.search(body):
        return None  # a bounded search on an error path (json.loads: ~10 ms per MB)
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    stack: list[tuple[str, Any]] = [("", obj)]
    while stack:  # depth first, in document order
        path, value = stack.pop()
        if isinstance(value, str):
            if not value.isascii():
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    return path or "the body"
        elif isinstance(value, dict):
            for key, item in reversed(value.items()):
                stack.append((f"{path}.{key}" if path else key, item))
                stack.append((f"{path} (a key)" if path else "a key", key))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in reversed(list(enumerate(value))))
    return None


def _unsupported_fields() -> frozenset[str]:
    from flowengine.entrypoints.openai.protocol import UNSUPPORTED_FIELDS

    return UNSUPPORTED_FIELDS


def too_deep() -> APIError:
    """A 400 for JSON nested deeper than the decoder goes (it recurses per level)."""
    return APIError(
        400,
        "the request body nests JSON too deeply (the limit is about 900 levels of "
        "arrays/objects); flatten it",
        code="invalid_json",
    )


def internal_error() -> APIError:
    # NOTE: the cause is logged server-side; the client never sees a traceback.
    return APIError(
        500, "internal server error; see the server log", type="server_error", code="internal_error"
    )
