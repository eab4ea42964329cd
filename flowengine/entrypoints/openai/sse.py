"""Server-sent events framing as OpenAI streams it.

Each event is `data: <json>\\n\\n`; the stream ends with `data: [DONE]\\n\\n`
(https://html.spec.whatwg.org/multipage/server-sent-events.html, OpenAI's streaming
guide). An error after the response has started cannot change the status code, so it
travels as an event holding OpenAI's error object, followed by `[DONE]`.
"""

from __future__ import annotations

from typing import Any

import orjson

from flowengine.entrypoints.openai.errors import APIError

DONE = b"data: [DONE]\n\n"
HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def event(data: Any) -> bytes:
    """One `data:` event. orjson never emits raw newlines, so one line suffices."""
    return b"data: " + orjson.dumps(data) + b"\n\n"


def error_event(err: APIError) -> bytes:
    return event(err.body())
