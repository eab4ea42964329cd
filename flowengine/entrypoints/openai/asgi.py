"""A small ASGI toolkit: request wrapper, JSON / streaming responses, disconnect watch.

Written for this server instead of a framework (the ASGI 3.0 HTTP spec is all we
need: https://asgi.readthedocs.io/en/latest/specs/www.html). JSON is encoded with
orjson.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson

from flowengine.entrypoints.openai.errors import APIError

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class ClientDisconnected(Exception):
    """The client closed the connection before the request body was read."""


class Request:
    """One HTTP request: method, path, lower-cased headers, and its body once read."""

    def __init__(self, scope: Scope, receive: Receive) -> None:
        self.scope = scope
        self.receive = receive
        self.method: str = scope["method"]
        self.path: str = scope["path"]
        self.headers: dict[str, str] = {
            k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]
        }
        self.body: bytes = b""
        self.body_read = False
        self.disconnected = False

    async def read_body(self, max_bytes: int) -> bytes:
        """Read the whole body. Raises APIError(413) past `max_bytes` bytes."""
        declared = self.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            raise _too_large(int(declared), max_bytes)
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await self.receive()
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
        self.body = b"".join(chunks)
        self.body_read = True
        return self.body

    async def discard_body(self, max_bytes: int) -> None:
        """Read and drop a body nobody read yet (an error answered before the handler
        ran), so the connection can carry the client's next request: an HTTP/1.1 server
        that finishes a response before the request's body has arrived must close the
        connection (Hypercorn does), and a keep-alive client that reuses it fails.
        A body over `max_bytes` is left unread; that connection closes. Raises
        ClientDisconnected.
        """
        if self.body_read:
            return
        try:
            await self.read_body(max_bytes)
        except APIError:
            pass

    def watch_disconnect(self, task: asyncio.Task[Any]) -> asyncio.Task[None]:
        """Cancel `task` when the client goes away (call after the body is read).

        Once the body is consumed, the next ASGI message can only be `http.disconnect`,
        so a task blocked on `receive()` learns of it at once, also while the handler
        waits on the engine (non-streaming) or writes a stream.
        """

        async def watch() -> None:
            while True:
                message = await self.receive()
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
    )


class Response:
    """A complete response: status, headers, body bytes."""

    def __init__(
        self,
        status: int,
        body: bytes = b"",
        *,
        content_type: str | None = "application/json",
        headers: dict[str, str] | None = None,
    ) -> None:
        self.status = status
        self.body = body
        self.headers = dict(headers or {})
        if content_type is not None:
            self.headers["content-type"] = content_type

    def raw_headers(self, extra: dict[str, str]) -> list[tuple[bytes, bytes]]:
        merged = {**self.headers, **extra}
        return [(k.encode("latin-1"), v.encode("latin-1")) for k, v in merged.items()]

    async def send(self, send: Send, extra_headers: dict[str, str]) -> None:
        headers = self.raw_headers(extra_headers)
        if self.status != 204:  # RFC 9110 §8.6: no Content-Length in a 204
            headers.append((b"content-length", str(len(self.body)).encode()))
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        await send({"type": "http.response.body", "body": self.body, "more_body": False})


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(status, orjson.dumps(data), headers=headers)


def error_response(err: APIError) -> Response:
    return json_response(err.body(), err.status, err.headers)


class StreamingResponse(Response):
    """A chunked response whose body comes from an async iterator of bytes.

    When sending ends, also because the client went away or the task was cancelled,
    the iterator is closed and then `cleanup` runs. NOTE: `cleanup` is what releases
    the engine requests: closing an async generator that never started does not run
    its `finally` blocks, so they cannot be relied on alone.
    """

    def __init__(
        self,
        chunks: AsyncIterator[bytes],
        *,
        cleanup: Callable[[], Awaitable[None]] | None = None,
        content_type: str = "text/event-stream",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(200, content_type=content_type, headers=headers)
        self.chunks = chunks
        self.cleanup = cleanup

    async def send(self, send: Send, extra_headers: dict[str, str]) -> None:
        try:
            async with contextlib.aclosing(self.chunks) as chunks:  # type: ignore[type-var]
                await send(
                    {
                        "type": "http.response.start",
                        "status": self.status,
                        "headers": self.raw_headers(extra_headers),
                    }
                )
                async for chunk in chunks:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            if self.cleanup is not None:
                await self.cleanup()
