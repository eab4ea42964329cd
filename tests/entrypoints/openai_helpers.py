"""Assertions shared by the OpenAI server tests (error shape, SSE framing, schemas)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx
import msgspec
import orjson

from flowengine.entrypoints.openai.responses import ErrorResponse

API_KEY = "test-key-123"
MAX_BODY_BYTES = 64 * 1024


def strict(body: bytes | str, type_: type) -> Any:
    """Decode a response body against a response struct (unknown fields fail)."""
    return msgspec.json.decode(body, type=type_, strict=True)


def assert_error(
    resp: httpx.Response, status: int, *, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    """The response is OpenAI's error object with this status (and code/param)."""
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"] == "application/json"
    strict(resp.content, ErrorResponse)
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if code is not None:
        assert err["code"] == code
    if param is not None:
        assert err["param"] == param
    assert "Traceback" not in err["message"]
    return err


def sse_events(raw: bytes) -> list[bytes]:
    """Split an SSE body into `data:` payloads, checking the framing of each event."""
    assert raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
    events = raw.split(b"\n\n")
    assert events[-1] == b""
    payloads = []
    for ev in events[:-1]:
        assert ev.startswith(b"data: ") and b"\n" not in ev, ev
        payloads.append(ev[len(b"data: ") :])
    assert payloads[-1] == b"[DONE]" and b"[DONE]" not in payloads[:-1]
    return payloads[:-1]


def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.005)


async def stream_text(
    client: httpx.AsyncClient,
    prompt: str,
    max_tokens: int,
    leave_after: int | None,
    **extra: Any,
) -> tuple[str, str]:
    """(request id, streamed greedy completion); leaves after `leave_after` events if
    given. `extra` fields go into the request body."""
    req = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, **extra}
    text, request_id, events = "", "", 0
    async with client.stream("POST", "/v1/completions", json=req) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if not line or line == "data: [DONE]":
                continue
            chunk = orjson.loads(line[len("data: ") :])
            request_id = chunk["id"]
            text += chunk["choices"][0]["text"]
            events += 1
            if leave_after is not None and events >= leave_after:
                break  # leaving the block closes the connection
    return request_id, text
