"""CORS and OPTIONS, as an ASGI middleware with vLLM's four settings.

vLLM (`--allowed-origins`, `--allowed-methods`, `--allowed-headers`,
`--allow-credentials`) hands these to Starlette's `CORSMiddleware`. This one keeps the
same meanings with two differences that the tests pin: a preflight is answered
`204 No Content`, and `"*"` methods means the methods the path really accepts (the
`Allow` list), not every HTTP method. Rules (https://fetch.spec.whatwg.org/#http-cors-protocol):

- An allowed `Origin` gets `Access-Control-Allow-Origin` (`*`, or the origin itself
  when only some origins are allowed or credentials are on) and `Vary: Origin`, on
  every response, errors included; other origins get no CORS headers (the browser
  then refuses to show the response).
- `OPTIONS` on a known path is answered here, without auth: `Allow` always, plus the
  preflight headers for an allowed origin whose requested method and headers are
  allowed. An unknown path is a 404.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from flowengine.entrypoints.openai.asgi import empty_response, error_response
from flowengine.entrypoints.openai.errors import APIError

PREFLIGHT_MAX_AGE_S = 600


class CORSMiddleware:
    """Args:
    app: the wrapped ASGI app.
    methods_for: the methods a path accepts (sorted; empty for an unknown path).
    allowed_origins: origins, or "*" for any; empty for no CORS headers at all.
    allowed_methods, allowed_headers: what a preflight may ask for ("*": anything
        the path accepts / any header).
    allow_credentials: send `Access-Control-Allow-Credentials: true`.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        methods_for: Callable[[Scope], list[str]],
        allowed_origins: Sequence[str] = (),
        allowed_methods: Sequence[str] = ("*",),
        allowed_headers: Sequence[str] = ("*",),
        allow_credentials: bool = False,
    ) -> None:
        self.app = app
        self.methods_for = methods_for
        self.origins = frozenset(allowed_origins)
        self.any_origin = "*" in self.origins
        self.methods = frozenset(m.upper() for m in allowed_methods)
        self.headers = frozenset(h.lower() for h in allowed_headers)
        self.allow_credentials = allow_credentials

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        origin = _header(scope, b"origin") if self.origins else None
        cors = self._origin_headers(origin) if origin is not None else None
        if scope["method"] == "OPTIONS":
            await self._options(scope, receive, send, cors)
            return
        if not cors:
            await self.app(scope, receive, send)
            return
        extra = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in cors.items()]

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_cors)

    def _origin_headers(self, origin: str) -> dict[str, str]:
        if not (self.any_origin or origin in self.origins):
            return {}
        echo = self.allow_credentials or not self.any_origin
        headers = {"access-control-allow-origin": origin if echo else "*", "vary": "origin"}
        if self.allow_credentials:
            headers["access-control-allow-credentials"] = "true"
        return headers

    async def _options(
        self, scope: Scope, receive: Receive, send: Send, cors: dict[str, str] | None
    ) -> None:
        methods = self.methods_for(scope)
        if not methods:
            err = APIError(
                404,
                f"no route OPTIONS {scope['path']}; /openapi.json lists the routes",
                code="not_found",
            )
            await error_response(err)(scope, receive, send)
            return
        allow = ", ".join([*methods, "OPTIONS"])
        headers = {"allow": allow}
        requested = _header(scope, b"access-control-request-method")
        if cors and requested is not None:
            allowed = [m for m in methods if "*" in self.methods or m in self.methods]
            asked = [
                h.strip().lower()
                for h in (_header(scope, b"access-control-request-headers") or "").split(",")
                if h.strip()
            ]
            if requested.upper() in allowed and ("*" in self.headers or set(asked) <= self.headers):
                headers.update(cors)
                headers["access-control-allow-methods"] = ", ".join([*allowed, "OPTIONS"])
                asked_raw = _header(scope, b"access-control-request-headers")
                if asked_raw:
                    headers["access-control-allow-headers"] = (
                        asked_raw if "*" in self.headers else ", ".join(sorted(self.headers))
                    )
                headers["access-control-max-age"] = str(PREFLIGHT_MAX_AGE_S)
        await empty_response(204, headers)(scope, receive, send)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None
