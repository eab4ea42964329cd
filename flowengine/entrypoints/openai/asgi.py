"""Request and response classes of the server, on Starlette's.

`APIRequest` is Starlette's `Request` plus what the OpenAI routes need around it: a
body read with a size limit (413) and a deadline (408), the drain of an unread body
after an early error (keep-alive), and a disconnect watch that cancels the handler.
Responses are Starlette `Response`s whose JSON is encoded with orjson; the streaming
response runs a cleanup (engine aborts) however it ends, and a stream cut by the
server (the graceful-shutdown timeout) ends with an error event and `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from starlette.requests import Request as StarletteRequest
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from flowengine.entrypoints.openai.errors import APIError

__all__ = [
    "APIRequest",
    "ClientDisconnected",
    "JSONResponse",
    "Response",
    "StreamingResponse",
    "error_response",
    "json_response",
]


class ClientDisconnected(Exception):
    """The client closed the connection before the request body was read."""


class APIRequest(StarletteRequest):
    """One HTTP request of an OpenAI route.

    Attributes:
        raw_body: the body bytes once `read_body` ran (b"" before; also what
            Starlette's `await request.body()` returns then).
        disconnected: True once the client was seen going away.
    """

    def __init__(self, scope: Scope, receive: Receive) -> None:
        super().__init__(scope, receive)
        self.raw_body = b""
        self.body_read = False
        self.disconnected = False

    async def read_body(self, max_bytes: int, timeout_s: float | None = None) -> bytes:
        """Read the whole body.

        Raises APIError(413) past `max_bytes` bytes, APIError(408) when the whole body
        has not arrived `timeout_s` seconds after the headers, ClientDisconnected.
        """
        declared = self.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            raise _too_large(int(declared), max_bytes)
        if timeout_s is None:
            return await self._read(max_bytes)
        try:
            async with asyncio.timeout(timeout_s):
                return await self._read(max_bytes)
        except TimeoutError:
            raise APIError(
                408,
                f"the request body did not arrive within {timeout_s:g} s; send it at once "
                "or raise --request-body-timeout",
                code="request_timeout",
                headers={"connection": "close"},
            ) from None

    async def _read(self, max_bytes: int) -> bytes:
        chunks: list[bytes] = []
        size = 0
        receive = self._receive
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.disconnected = True
                raise ClientDisconnected
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > max_bytes:
                raise _too_large(size, max_bytes)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self.raw_body = self._body = body
        self.body_read = True
        # NOTE: Starlette's own readers must not call receive() again for the body.
        self._stream_consumed = True
        return body

    async def discard_body(self, max_bytes: int, timeout_s: float | None = None) -> None:
        """Read and drop a body nobody read yet (an error answered before the handler
        ran), so the connection can carry the client's next request: an HTTP/1.1 server
        that finishes a response before the request's body has arrived must close the
        connection (Hypercorn does), and a keep-alive client that reuses it fails.
        A body over `max_bytes`, or slower than `timeout_s`, is left unread; that
        connection closes. Raises ClientDisconnected.
        """
        if self.body_read or self.scope["method"] in ("GET", "HEAD"):
            return
        try:
            await self.read_body(max_bytes, timeout_s)
        except APIError:
            pass

    def watch_disconnect(self, task: asyncio.Task[Any]) -> asyncio.Task[None]:
        """Cancel `task` when the client goes away (call after the body is read).

        Once the body is consumed, the next ASGI message can only be `http.disconnect`,
        so a task blocked on `receive()` learns of it at once, also while the handler
        waits on the engine (non-streaming) or writes a stream.
        """
        receive = self._receive

        async def watch() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    self.disconnected = True
                    task.cancel()
                    return

        return asyncio.get_running_loop().create_task(watch())


def _too_large(size: int, max_bytes: int) -> APIError:
    return APIError(
        413,
        f"the request body has {size} bytes or more, over the limit of {max_bytes}; "
        "send a smaller request or raise --max-request-body-bytes",
        code="request_too_large",
        # The rest of the body stays unread, so the server closes this connection after
        # the answer; saying so keeps a keep-alive client from sending its next request
        # on it (it would see the connection drop without a response).
        headers={"connection": "close"},
    )


class JSONResponse(Response):
    """A JSON response encoded with orjson (`content-type: application/json`)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _send_whole(self, scope, send)


class PlainResponse(Response):
    """Bytes with the given content type (or none), no body on HEAD."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _send_whole(self, scope, send)


async def _send_whole(response: Response, scope: Scope, send: Send) -> None:
    # Starlette's Response.__call__ sends the body also for HEAD; RFC 9110 §9.3.2 says
    # a HEAD response has the GET response's headers and no content.
    body = b"" if scope["method"] == "HEAD" else response.body
    await send(
        {
            "type": "http.response.start",
            "status": response.status_code,
            "headers": response.raw_headers,
        }
    )
    await send({"type": "http.response.body", "body": body})


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return JSONResponse(data, status, headers)


def error_response(err: APIError) -> Response:
    return JSONResponse(err.body(), err.status, err.headers or None)


def empty_response(status: int, headers: dict[str, str] | None = None) -> Response:
    """A response with no content type; no Content-Length for 204 (RFC 9110 §8.6)."""
    return PlainResponse(b"", status, headers)


def plain_response(body: bytes, content_type: str | None) -> Response:
    return PlainResponse(body, 200, media_type=content_type)


# Scope key under which the app puts the ASGI server's own `send` when no middleware of
# the user's wraps it (app.py: OpenAIApp.__call__). A streamed body's chunks go to it
# directly: Starlette's error and exception middleware and our CORS layer only look at
# the `http.response.start` message, and skipping them saves three coroutine calls per
# chunk (one chunk per token per streamed request).
BODY_SEND_KEY = "flowengine.body_send"


class StreamingResponse(Response):
    """A chunked response whose body comes from an async iterator of bytes.

    When sending ends, also because the client went away or the task was cancelled,
    the iterator is closed and then `cleanup` runs. NOTE: `cleanup` is what releases
    the engine requests: closing an async generator that never started does not run
    its `finally` blocks, so they cannot be relied on alone.

    A server that must end the stream (graceful-shutdown timeout) sets `cut_error` and
    cancels the task: the stream then ends with that error as an event and
    `data: [DONE]` (`error_event`/`done_event` frame them), not mid-body.
    """

    def __init__(
        self,
        chunks: AsyncIterator[bytes],
        *,
        cleanup: Callable[[], Awaitable[None]] | None = None,
        media_type: str = "text/event-stream",
        headers: dict[str, str] | None = None,
        error_event: Callable[[APIError], bytes] | None = None,
        done_event: bytes = b"",
    ) -> None:
        self.status_code = 200
        self.media_type = media_type
        self.background = None
        self.body = b""
        # Built here, not by Starlette's init_headers: no content-length (the body is
        # chunked) and no charset appended to text/event-stream (what OpenAI sends).
        merged = {"content-type": media_type, **(headers or {})}
        self.raw_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in merged.items()]
        self.chunks = chunks
        self.cleanup = cleanup
        self.cut_error: APIError | None = None
        self._error_event = error_event
        self._done_event = done_event

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False
        # The start goes through the middleware (it may add headers and notes that the
        # response began); the body chunks, when the app allows it, straight to the
        # server (see BODY_SEND_KEY).
        send_body = scope.get(BODY_SEND_KEY, send)
        try:
            async with contextlib.aclosing(self.chunks) as chunks:  # type: ignore[type-var]
                await send(
                    {"type": "http.response.start", "status": 200, "headers": self.raw_headers}
                )
                started = True
                async for chunk in chunks:
                    await send_body({"type": "http.response.body", "body": chunk, "more_body": True})
            await send_body({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self.cut_error is None or task is None:
                raise
            task.uncancel()  # the server's cut, handled here: end the stream properly
            if self.cleanup is not None:
                await self.cleanup()
                self.cleanup = None
            tail = self._done_event
            if self._error_event is not None:
                tail = self._error_event(self.cut_error) + tail
            if not started:
                await send(
                    {"type": "http.response.start", "status": 200, "headers": self.raw_headers}
                )
            await send({"type": "http.response.body", "body": tail, "more_body": False})
        finally:
            if self.cleanup is not None:
                await self.cleanup()
