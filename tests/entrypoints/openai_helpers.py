"""Assertions shared by the OpenAI server tests (error shape, SSE framing, schemas)."""

from __future__ import annotations

from typing import Any

import httpx
import msgspec

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
