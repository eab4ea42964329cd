"""The ASGI application, on Starlette: routes, API key, CORS, body limits, disconnects,
draining.

`OpenAIApp` builds a `Starlette` app from the route table (router.py). Starlette
routes (404/405, `HEAD` for every `GET`, `root_path`) and runs the middleware: CORS
and OPTIONS outermost (cors.py), then the `--middleware` hooks. Each route's endpoint
(`_Endpoint`) then, per request: checks the API key (401) → refuses new work while
draining (503) → checks the Content-Type of a JSON body (415) → reads the body (413
past the size limit, 408 past the body timeout) → watches for the client going away
(the handler task is cancelled, which aborts its engine request) → runs the handler
and sends its response. Every error is OpenAI's error object (Anthropic's shape on
the Anthropic routes: `Route.render_error`); an unexpected exception is logged with its
traceback and answered as a bare 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import importlib
import inspect
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request as StarletteRequest
from starlette.routing import Match
from starlette.routing import Route as StarletteRoute
from starlette.types import Receive, Scope, Send

from flowengine.entrypoints.openai import responses as rs
from flowengine.entrypoints.openai import serving_anthropic as anthropic
from flowengine.entrypoints.openai import serving_misc as misc
from flowengine.entrypoints.openai import serving_responses as responses
from flowengine.entrypoints.openai.asgi import (
    BODY_SEND_KEY,
    APIRequest,
    ClientDisconnected,
    PlainResponse,
    Response,
    StreamingResponse,
    error_response,
)
from flowengine.entrypoints.openai.context import ServingContext
from flowengine.entrypoints.openai.cors import CORSMiddleware
from flowengine.entrypoints.openai.errors import APIError, internal_error
from flowengine.entrypoints.openai.openapi import build_openapi
from flowengine.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from flowengine.entrypoints.openai.protocol_anthropic import (
    AnthropicErrorResponse,
    CountTokensRequest,
    MessageResponse,
    MessagesRequest,
    TokenCount,
)
from flowengine.entrypoints.openai.protocol_responses import (
    ResponseDeleted,
    ResponseObject,
    ResponsesRequest,
)
from flowengine.entrypoints.openai.responses_store import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_ENTRIES,
    ResponseStore,
)
from flowengine.entrypoints.openai.router import Route, Router
from flowengine.entrypoints.openai.serving_chat import create_chat_completion
from flowengine.entrypoints.openai.serving_completions import create_completion
from flowengine.entrypoints.openai.serving_embeddings import (
    EmbeddingRequest,
    EmbeddingResponse,
    create_embedding,
)

logger = logging.getLogger(__name__)

# 32 MiB: a few hundred thousand tokens of text or token ids; raise it for longer prompts.
DEFAULT_MAX_REQUEST_BODY_BYTES = 32 << 20
# Seconds from the end of the headers to the end of the body. A client sending 32 MiB
# at 10 Mbit/s needs ~27 s; a slow-body attack (1 byte every 2 s) is cut after this.
DEFAULT_REQUEST_BODY_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class AppOptions:
    """HTTP-level settings of the app.

    Attributes:
        api_key: if set, routes that need auth require `Authorization: Bearer <key>`.
        allowed_origins: CORS origins allowed to call from a browser ("*" for any);
            empty means no CORS headers (browsers refuse cross-origin calls).
        allowed_methods, allowed_headers: what a CORS preflight may ask for ("*": any
            method the path accepts / any header); vLLM's `--allowed-methods`,
            `--allowed-headers`.
        allow_credentials: CORS `Access-Control-Allow-Credentials: true`.
        max_request_body_bytes: larger bodies are answered 413.
        request_body_timeout_s: a body still incomplete this many seconds after the
            headers is answered 408 and its connection closed (None: no limit).
        drain_retry_after_s: `Retry-After` of the 503 sent while draining.
        middleware: import paths ("pkg.module.attr" or "pkg.module:attr") of ASGI
            middleware classes (added with `add_middleware`) or `async def
            f(request, call_next)` functions (as `@app.middleware("http")`), vLLM's
            `--middleware`; applied in order, the first outermost, inside CORS.
        root_path: the path prefix a proxy strips (`--root-path`); the OpenAPI
            document names it as the server URL.
        on_startup: called once the server listens (lifespan startup).
        responses_store_max: most responses the Responses API keeps in memory for
            `GET /v1/responses/{id}` and `previous_response_id` (LRU; 0 keeps none);
            `--responses-store-max`.
        responses_store_max_bytes: most bytes they may hold (LRU past it);
            `--responses-store-max-bytes`.
    """

    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    request_body_timeout_s: float | None = DEFAULT_REQUEST_BODY_TIMEOUT_S
    drain_retry_after_s: float = 5.0
    middleware: tuple[str, ...] = ()
    root_path: str = ""
    on_startup: Sequence[Callable[[], None]] = field(default_factory=tuple)
    responses_store_max: int = DEFAULT_MAX_ENTRIES
    responses_store_max_bytes: int = DEFAULT_MAX_BYTES


def build_routes(
    ctx: ServingContext, openapi: Callable[[], Response], store: ResponseStore | None = None
) -> list[Route]:
    """The route table (method, path, handler, auth, drain behaviour, schemas).
    `store`: the Responses API's store (a default-sized one if None)."""
    store = ResponseStore() if store is None else store

    def h(fn):  # bind the context: handlers take (ctx, request)
        return partial(fn, ctx)

    def hs(fn):  # the Responses handlers also take the store
        return partial(fn, ctx, store)

    # Anthropic's routes answer errors in Anthropic's shape and accept `x-api-key`.
    claude = {
        "render_error": anthropic.anthropic_error_response,
        "error_type": AnthropicErrorResponse,
        "accepts_x_api_key": True,
    }

    async def openapi_handler(request: APIRequest) -> Response:
        return openapi()

    return [
        Route("GET", "/v1/models", h(misc.list_models), "List the served models",
              response_type=rs.ModelList),
        Route("GET", "/v1/models/{model}", h(misc.retrieve_model), "One served model",
              response_type=rs.ModelCard, match_path="/v1/models/{model:path}",
              path_params=("model",)),
        Route("POST", "/v1/completions", h(create_completion), "Create a completion",
              request_types=(CompletionRequest,), response_type=rs.CompletionResponse,
              streams=True),
        Route("POST", "/v1/chat/completions", h(create_chat_completion),
              "Create a chat completion", request_types=(ChatCompletionRequest,),
              response_type=rs.ChatCompletionResponse, streams=True),
        Route("POST", "/v1/responses", hs(responses.create_response), "Create a model response "
              "(OpenAI Responses API)", request_types=(ResponsesRequest,),
              response_type=ResponseObject, streams=True),
        Route("GET", "/v1/responses/{response_id}", hs(responses.retrieve_response),
              "A stored response", response_type=ResponseObject, path_params=("response_id",)),
        Route("DELETE", "/v1/responses/{response_id}", hs(responses.delete_response),
              "Delete a stored response", response_type=ResponseDeleted,
              path_params=("response_id",)),
        Route("POST", "/v1/responses/{response_id}/cancel", hs(responses.cancel_response),
              "Cancel a background response (none run here: 400 for a stored one)",
              response_type=ResponseObject, path_params=("response_id",)),
        Route("POST", "/v1/messages", h(anthropic.create_message), "Create a message "
              "(Anthropic Messages API)", request_types=(MessagesRequest,),
              response_type=MessageResponse, streams=True, **claude),
        Route("POST", "/v1/messages/count_tokens", h(anthropic.count_tokens),
              "Count the tokens of a message request (Anthropic)",
              request_types=(CountTokensRequest,), response_type=TokenCount, **claude),
        Route("POST", "/v1/embeddings", h(create_embedding), "Create embeddings (pooling models)",
              request_types=(EmbeddingRequest,), response_type=EmbeddingResponse),
        Route("POST", "/tokenize", h(misc.tokenize), "Token ids of a prompt or of messages",
              request_types=(TokenizeCompletionRequest, TokenizeChatRequest),
              response_type=rs.TokenizeResponse),
        Route("POST", "/detokenize", h(misc.detokenize), "Text of token ids",
              request_types=(DetokenizeRequest,), response_type=rs.DetokenizeResponse),
        Route("GET", "/health", h(misc.health), "200 while the engine serves, 503 otherwise",
              requires_auth=False, response_content_type="text/plain"),
        # vLLM's /ping (SageMaker's health check), GET and POST: /health's answer.
        Route("GET", "/ping", h(misc.health), "As /health (SageMaker's name)",
              requires_auth=False, response_content_type="text/plain"),
        Route("POST", "/ping", h(misc.health), "As /health (SageMaker's name)",
              requires_auth=False, response_content_type="text/plain"),
        Route("GET", "/version", h(misc.version), "Server version", requires_auth=False,
              while_draining=True, response_type=rs.VersionResponse),
        Route("GET", "/metrics", h(misc.metrics), "Prometheus metrics", requires_auth=False,
              while_draining=True, response_content_type="text/plain"),
        Route("GET", "/openapi.json", openapi_handler, "This OpenAPI document",
              requires_auth=False, while_draining=True),
    ]  # fmt: skip


def load_middleware(path: str) -> Middleware:
    """The Starlette `Middleware` for an import path (see AppOptions.middleware).

    Raises ValueError for a path that does not import or names neither a class nor an
    async function.
    """
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"--middleware {path!r} cannot be imported: {err}") from err
    if inspect.isclass(obj):
        return Middleware(obj)
    if inspect.iscoroutinefunction(obj):
        return Middleware(BaseHTTPMiddleware, dispatch=obj)
    raise ValueError(
        f"--middleware {path!r} is neither an ASGI middleware class nor an "
        "'async def f(request, call_next)' function"
    )


class _Flight:
    """One request in flight: its response once the handler returned, and the error
    it was cut with by the server (graceful-shutdown timeout), if any."""

    __slots__ = ("cut_error", "response")

    def __init__(self) -> None:
        self.response: Response | None = None
        self.cut_error: APIError | None = None


def bearer_matches(authorization: str, api_key: str) -> bool:
    """Whether an `Authorization` value (HTTP header, gRPC metadata) is `Bearer <api_key>`,
    compared in constant time."""
    scheme, _, token = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                              api_key.encode())


class OpenAIApp:
    """ASGI app serving the OpenAI routes for one `ServingContext`."""

    def __init__(self, ctx: ServingContext, options: AppOptions) -> None:
        self.ctx = ctx
        self.options = options
        self.responses_store = ResponseStore(
            options.responses_store_max, options.responses_store_max_bytes
        )
        self.router = Router(build_routes(ctx, self._openapi, self.responses_store))
        self._openapi_body = orjson.dumps(
            build_openapi(
                self.router.routes,
                has_api_key=options.api_key is not None,
                root_path=options.root_path,
                max_n=ctx.limits.max_n,
                max_logprobs=ctx.limits.max_logprobs,
            )
        )
        self.draining = False
        self._in_flight: dict[asyncio.Task[Any], _Flight] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        by_path: dict[str, dict[str, Route]] = {}
        for route in self.router.routes:
            by_path.setdefault(route.match_path or route.path, {})[route.method] = route
        routes = [
            StarletteRoute(path, _Endpoint(self, by_method), methods=list(by_method))
            for path, by_method in by_path.items()
        ]
        middleware = [
            Middleware(
                CORSMiddleware,
                methods_for=self.methods_for,
                allowed_origins=options.allowed_origins,
                allowed_methods=options.allowed_methods,
                allowed_headers=options.allowed_headers,
                allow_credentials=options.allow_credentials,
            ),
            *(load_middleware(m) for m in options.middleware),
        ]
        self.starlette = Starlette(
            routes=routes,
            middleware=middleware,
            exception_handlers={HTTPException: self._routing_error},
            lifespan=self._lifespan,
        )
        # A trailing slash is a 404 (OpenAI's paths have none), not a 307 redirect.
        self.starlette.router.redirect_slashes = False

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.options.middleware and scope["type"] == "http":
            # The server's own send, for stream body chunks (see asgi.BODY_SEND_KEY);
            # with `--middleware` hooks every message goes through the stack.
            scope[BODY_SEND_KEY] = send
        await self.starlette(scope, receive, send)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        for hook in self.options.on_startup:
            hook()
        yield

    def _openapi(self) -> Response:
        return PlainResponse(self._openapi_body, 200, media_type="application/json")

    def methods_for(self, scope: Scope) -> list[str]:
        """The methods `scope`'s path accepts, sorted (HEAD included for GET routes)."""
        for route in self.starlette.router.routes:
            match, _ = route.matches(scope)
            if match is not Match.NONE:
                return sorted(route.methods or ())
        return []

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

    def cut_in_flight(self) -> int:
        """End every request still in flight (the graceful-shutdown timeout): a stream
        gets an error event and `data: [DONE]`, a request not yet answered a 503.
        Their engine requests are aborted. Returns how many were cut."""
        err = APIError(
            503,
            "the server is shutting down and its graceful timeout ended this request "
            "before it finished; retry it on another replica",
            type="service_unavailable_error",
            code="server_shutdown",
        )
        for task, flight in list(self._in_flight.items()):
            flight.cut_error = err
            if isinstance(flight.response, StreamingResponse):
                flight.response.cut_error = err
            task.cancel()
        return len(self._in_flight)

    async def _routing_error(self, request: StarletteRequest, exc: Exception) -> Response:
        """Starlette's 404/405 as OpenAI's error object."""
        assert isinstance(exc, HTTPException)
        method, path = request.method, request.url.path
        if exc.status_code == 405:
            allowed = ", ".join(sorted((exc.headers or {}).get("Allow", "").split(", ")))
            err = APIError(
                405,
                f"{path} does not accept {method}; use {allowed}",
                code="method_not_allowed",
                headers={"allow": allowed},
            )
        elif exc.status_code == 404:
            err = APIError(
                404, f"no route {method} {path}; /openapi.json lists the routes", code="not_found"
            )
        else:
            err = APIError(exc.status_code, str(exc.detail))
        # Read the body the client is still sending, so its connection stays usable.
        with contextlib.suppress(ClientDisconnected):
            await APIRequest(request.scope, request.receive).discard_body(
                self.options.max_request_body_bytes, self.options.request_body_timeout_s
            )
        # A path of another API (Anthropic's) answers in that API's error shape.
        root = self.options.root_path
        at_path = self.router.routes_at(
            path[len(root) :] if root and path.startswith(root + "/") else path
        )
        return (at_path[0].render_error if at_path else error_response)(err)

    async def serve(self, route: Route, scope: Scope, receive: Receive, send: Send) -> None:
        """Run one request of `route` (see the module docstring for the steps)."""
        request = APIRequest(scope, receive)
        task = asyncio.current_task()
        assert task is not None  # an ASGI app always runs inside a task
        options = self.options
        watcher: asyncio.Task[None] | None = None
        flight: _Flight | None = None
        try:
            try:
                self._admit(route, request)
                flight = self._enter(task)
                if route.request_types:
                    _check_json_content_type(request)
                    await request.read_body(
                        options.max_request_body_bytes, options.request_body_timeout_s
                    )
                watcher = request.watch_disconnect(task)
                response = await route.handler(request)
            except APIError as err:
                if err.status not in (408, 413):
                    await request.discard_body(
                        options.max_request_body_bytes, options.request_body_timeout_s
                    )
                response = route.render_error(err)
            except (ClientDisconnected, asyncio.CancelledError):
                raise
            except Exception:
                logger.exception("%s %s failed", request.method, request.url.path)
                response = route.render_error(internal_error())
            if flight is not None:
                flight.response = response
            await response(scope, receive, send)
        except ClientDisconnected:  # gone while sending its body
            logger.info("%s %s: client disconnected", request.method, request.url.path)
        except asyncio.CancelledError:
            if request.disconnected:
                task.uncancel()  # our watcher's cancel, handled here
                logger.info("%s %s: client disconnected", request.method, request.url.path)
            elif flight is not None and flight.cut_error is not None:
                task.uncancel()  # cut at the graceful timeout: answer, then end
                if flight.response is None:
                    await route.render_error(flight.cut_error)(scope, receive, send)
            else:
                raise  # cancelled by the server (shutdown), not by the client
        finally:
            if watcher is not None:
                watcher.cancel()
            if flight is not None:
                self._leave(task)

    def _admit(self, route: Route, request: APIRequest) -> None:
        if route.requires_auth and self.options.api_key is not None:
            self._check_api_key(request, route.accepts_x_api_key)
        if self.draining and not route.while_draining:
            raise APIError(
                503,
                "the server is shutting down; send the request to another replica or retry",
                type="service_unavailable_error",
                code="server_draining",
                retry_after_s=self.options.drain_retry_after_s,
            )

    def _check_api_key(self, request: APIRequest, accepts_x_api_key: bool = False) -> None:
        """Raise APIError(401) unless the request carries the server's key, as
        `Authorization: Bearer <key>` or, where `accepts_x_api_key`, `x-api-key: <key>`
        (Anthropic's header). Keys are compared in constant time."""
        expected = (self.options.api_key or "").encode()
        if bearer_matches(request.headers.get("authorization", ""), self.options.api_key or ""):
            return
        x_api_key = request.headers.get("x-api-key") if accepts_x_api_key else None
        if x_api_key is not None and hmac.compare_digest(x_api_key.strip().encode(), expected):
            return
        how = "'Authorization: Bearer <key>'"
        if accepts_x_api_key:
            how = f"'x-api-key: <key>' or {how}"
        raise APIError(
            401,
            f"invalid or missing API key; send the header {how}",
            code="invalid_api_key",
            headers={"www-authenticate": "Bearer"},
        )

    def _enter(self, task: asyncio.Task[Any]) -> _Flight:
        flight = self._in_flight[task] = _Flight()
        self._idle.clear()
        return flight

    def _leave(self, task: asyncio.Task[Any]) -> None:
        self._in_flight.pop(task, None)
        if not self._in_flight:
            self._idle.set()


def _check_json_content_type(request: APIRequest) -> None:
    """Raise APIError(415) unless the body is declared JSON.

    `application/json` and `application/*+json` are JSON. A body with no Content-Type is
    taken as JSON (as FastAPI, hence vLLM, does) unless the request carries an `Origin`:
    a browser sends a cross-origin POST without a CORS preflight only with a "simple"
    Content-Type (text/plain, form types) or with none (a Blob body), so refusing those
    means a web page cannot make the server generate on a visitor's behalf.
    """
    content_type = request.headers.get("content-type")
    if content_type is None:
        if request.headers.get("origin") is None:
            return
        shown = "no Content-Type"
    else:
        media = content_type.partition(";")[0].strip().lower()
        if media == "application/json" or (
            media.startswith("application/") and media.endswith("+json")
        ):
            return
        shown = f"Content-Type {content_type!r}"
    raise APIError(
        415,
        f"the request body has {shown}; send JSON with 'Content-Type: application/json'",
        code="unsupported_media_type",
    )


class _Endpoint:
    """The Starlette endpoint (an ASGI app) of one path: dispatches on the method."""

    def __init__(self, app: OpenAIApp, by_method: dict[str, Route]) -> None:
        self.app = app
        self.by_method = dict(by_method)
        if "GET" in by_method:
            self.by_method.setdefault("HEAD", by_method["GET"])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Starlette answered 405 already for a method not in this path's list.
        await self.app.serve(self.by_method[scope["method"]], scope, receive, send)
