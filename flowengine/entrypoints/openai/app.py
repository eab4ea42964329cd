"""The ASGI application: routing, API key, CORS, body limit, disconnects, draining.

`OpenAIApp` is a plain ASGI 3 callable (no framework). Per HTTP request it:
routes (404/405) → checks the API key (401) → refuses new work while draining (503)
→ reads the body (413 past the limit) → watches for the client going away (the
handler task is cancelled, which aborts its engine request) → runs the handler and
sends its response. Every error is OpenAI's error object; an unexpected exception
is logged with its traceback and answered as a bare 500.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import orjson

from flowengine.entrypoints.openai import responses as rs
from flowengine.entrypoints.openai import serving_misc as misc
from flowengine.entrypoints.openai.asgi import (
    ClientDisconnected,
    Receive,
    Request,
    Response,
    Scope,
    Send,
    error_response,
)
from flowengine.entrypoints.openai.context import ServingContext
from flowengine.entrypoints.openai.errors import APIError, internal_error
from flowengine.entrypoints.openai.openapi import build_openapi
from flowengine.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from flowengine.entrypoints.openai.router import Route, Router
from flowengine.entrypoints.openai.serving_chat import create_chat_completion
from flowengine.entrypoints.openai.serving_completions import create_completion

logger = logging.getLogger(__name__)

# 32 MiB: a few hundred thousand tokens of text or token ids; raise it for longer prompts.
DEFAULT_MAX_REQUEST_BODY_BYTES = 32 << 20


@dataclass(frozen=True)
class AppOptions:
    """HTTP-level settings of the app.

    Attributes:
        api_key: if set, routes that need auth require `Authorization: Bearer <key>`.
        allowed_origins: CORS origins allowed to call from a browser ("*" for any);
            empty means no CORS headers (browsers refuse cross-origin calls).
        max_request_body_bytes: larger bodies are answered 413.
        drain_retry_after_s: `Retry-After` of the 503 sent while draining.
    """

    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    drain_retry_after_s: float = 5.0
    on_startup: Sequence[Callable[[], None]] = field(default_factory=tuple)


def build_routes(ctx: ServingContext, openapi: Callable[[], Response]) -> list[Route]:
    """The route table (method, path, handler, auth, drain behaviour, schemas)."""

    def h(fn):  # bind the context: handlers take (ctx, request)
        return partial(fn, ctx)

    async def openapi_handler(request: Request) -> Response:
        return openapi()

    return [
        Route("GET", "/v1/models", h(misc.list_models), "List the served models",
              response_type=rs.ModelList),
        Route("POST", "/v1/completions", h(create_completion), "Create a completion",
              request_types=(CompletionRequest,), response_type=rs.CompletionResponse,
              streams=True),
        Route("POST", "/v1/chat/completions", h(create_chat_completion),
              "Create a chat completion", request_types=(ChatCompletionRequest,),
              response_type=rs.ChatCompletionResponse, streams=True),
        Route("POST", "/tokenize", h(misc.tokenize), "Token ids of a prompt or of messages",
              request_types=(TokenizeCompletionRequest, TokenizeChatRequest),
              response_type=rs.TokenizeResponse),
        Route("POST", "/detokenize", h(misc.detokenize), "Text of token ids",
              request_types=(DetokenizeRequest,), response_type=rs.DetokenizeResponse),
        Route("GET", "/health", h(misc.health), "200 while the engine serves, 503 otherwise",
              requires_auth=False, response_content_type="text/plain"),
        Route("GET", "/version", h(misc.version), "Server version", requires_auth=False,
              while_draining=True, response_type=rs.VersionResponse),
        Route("GET", "/metrics", h(misc.metrics), "Prometheus metrics", requires_auth=False,
              while_draining=True, response_content_type="text/plain"),
        Route("GET", "/openapi.json", openapi_handler, "This OpenAPI document",
              requires_auth=False, while_draining=True),
    ]  # fmt: skip


class OpenAIApp:
    """ASGI app serving the OpenAI routes for one `ServingContext`."""

    def __init__(self, ctx: ServingContext, options: AppOptions) -> None:
        self.ctx = ctx
        self.options = options
        self.router = Router(build_routes(ctx, self._openapi))
        self._openapi_body = orjson.dumps(
            build_openapi(self.router.routes, has_api_key=options.api_key is not None)
        )
        self.draining = False
        self.num_in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def _openapi(self) -> Response:
        return Response(200, self._openapi_body)

    def start_draining(self) -> None:
        """From now on, new work is answered 503; in-flight requests continue."""
        self.draining = True

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no request is in flight; False if `timeout_s` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            await self._http(Request(scope, receive), send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                for hook in self.options.on_startup:
                    hook()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, request: Request, send: Send) -> None:
        cors = self._cors_headers(request)
        task = asyncio.current_task()
        assert task is not None  # an ASGI app always runs inside a task
        watcher: asyncio.Task[None] | None = None
        counted = False
        try:
            try:
                if request.method == "OPTIONS":
                    await self._preflight(request).send(send, cors)
                    return
                route = self._admit(request)
                self._enter()
                counted = True
                if request.method == "POST":
                    await request.read_body(self.options.max_request_body_bytes)
                watcher = request.watch_disconnect(task)
                response = await route.handler(request)
            except APIError as err:
                if err.status != 413:
                    await request.discard_body(self.options.max_request_body_bytes)
                response = error_response(err)
            except (ClientDisconnected, asyncio.CancelledError):
                raise
            except Exception:
                logger.exception("%s %s failed", request.method, request.path)
                response = error_response(internal_error())
            await response.send(send, cors)
        except ClientDisconnected:  # gone while sending its body
            logger.info("%s %s: client disconnected", request.method, request.path)
        except asyncio.CancelledError:
            if not request.disconnected:
                raise  # cancelled by the server (shutdown), not by the client
            task.uncancel()  # our watcher's cancel, handled here
            logger.info("%s %s: client disconnected", request.method, request.path)
        finally:
            if watcher is not None:
                watcher.cancel()
            if counted:
                self._leave()

    def _preflight(self, request: Request) -> Response:
        """OPTIONS: the allowed methods, plus CORS preflight headers for allowed origins."""
        methods = self.router.methods(request.path)
        if not methods:
            self.router.match(request.method, request.path)  # raises the 404
        headers = {"allow": ", ".join([*methods, "OPTIONS"])}
        if self._cors_headers(request):
            headers["access-control-allow-methods"] = headers["allow"]
            requested = request.headers.get("access-control-request-headers")
            if requested:
                headers["access-control-allow-headers"] = requested
            headers["access-control-max-age"] = "600"
        return Response(204, content_type=None, headers=headers)

    def _admit(self, request: Request) -> Route:
        route = self.router.match(request.method, request.path)
        if route.requires_auth and self.options.api_key is not None:
            self._check_api_key(request)
        if self.draining and not route.while_draining:
            raise APIError(
                503,
                "the server is shutting down; send the request to another replica or retry",
                type="service_unavailable_error",
                code="server_draining",
                retry_after_s=self.options.drain_retry_after_s,
            )
        return route

    def _check_api_key(self, request: Request) -> None:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        expected = self.options.api_key or ""
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), expected.encode()
        ):
            raise APIError(
                401,
                "invalid or missing API key; send the header 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                headers={"www-authenticate": "Bearer"},
            )

    def _enter(self) -> None:
        self.num_in_flight += 1
        self._idle.clear()

    def _leave(self) -> None:
        self.num_in_flight -= 1
        if self.num_in_flight == 0:
            self._idle.set()

    def _cors_headers(self, request: Request) -> dict[str, str]:
        origin = request.headers.get("origin")
        allowed = self.options.allowed_origins
        if origin is None or not allowed or ("*" not in allowed and origin not in allowed):
            return {}
        return {"access-control-allow-origin": "*" if "*" in allowed else origin, "vary": "origin"}
