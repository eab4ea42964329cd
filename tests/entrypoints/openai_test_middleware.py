"""ASGI middleware for the `--middleware` tests: a class and a dispatch function."""

from __future__ import annotations

from typing import Any

SEEN_PATHS: list[str] = []
SEEN_BODIES: list[bytes] = []  # every body chunk StampMiddleware passed on, in order


class StampMiddleware:
    """Pure ASGI middleware: records each HTTP path and adds `x-stamp: class`."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        SEEN_PATHS.append(scope["path"])

        async def stamped(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message["headers"], (b"x-stamp", b"class")]}
            elif message["type"] == "http.response.body":
                SEEN_BODIES.append(message.get("body", b""))
            await send(message)

        await self.app(scope, receive, stamped)


async def stamp_dispatch(request: Any, call_next: Any) -> Any:
    """`@app.middleware("http")`-style function: adds `x-stamp-fn: <method>`."""
    response = await call_next(request)
    response.headers["x-stamp-fn"] = request.method
    return response


NOT_MIDDLEWARE = 42
