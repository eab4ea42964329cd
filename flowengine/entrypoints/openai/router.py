"""The route table: per-route metadata (auth, drain behaviour, OpenAPI schemas).

Starlette routes the requests (app.py builds one Starlette `Route` per path from this
table); `Router` keeps the table itself, which the OpenAPI document is generated
from, and answers exact-path lookups.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from flowengine.entrypoints.openai.asgi import APIRequest, Response, error_response
from flowengine.entrypoints.openai.errors import APIError
from flowengine.entrypoints.openai.responses import ErrorResponse

Handler = Callable[[APIRequest], Awaitable[Response]]


@dataclass(frozen=True)
class Route:
    """One method + path.

    Attributes:
        requires_auth: needs `Authorization: Bearer <api key>` when the server has a key.
        while_draining: still served after SIGTERM (metrics, version); other routes
            answer 503 then so that load balancers move traffic away.
        request_types: msgspec structs the body may match (OpenAPI `oneOf` if several).
        response_type: msgspec struct of a JSON success body, for the OpenAPI document.
        streams: may answer `text/event-stream` (when the request asks `stream: true`).
        match_path: the Starlette path pattern when it differs from `path` (the
            OpenAPI form), e.g. "/v1/models/{model:path}" for "/v1/models/{model}".
        path_params: names of the path parameters (strings), for OpenAPI.
        render_error: the error response of this route (OpenAI's error object unless
            the route speaks another API, e.g. Anthropic's shape on /v1/messages);
            every error of the request, the app's own included, goes through it.
        error_type: msgspec struct of that error body, for the OpenAPI document.
        accepts_x_api_key: the API key may also come as `x-api-key: <key>`
            (Anthropic's header), besides `Authorization: Bearer <key>`.
    """

    method: str
    path: str
    handler: Handler
    summary: str
    requires_auth: bool = True
    while_draining: bool = False
    request_types: tuple[type, ...] = ()
    response_type: type | None = None
    response_content_type: str = "application/json"
    streams: bool = False
    match_path: str | None = None
    path_params: tuple[str, ...] = ()
    render_error: Callable[[APIError], Response] = error_response
    error_type: type = ErrorResponse
    accepts_x_api_key: bool = False


class Router:
    """Finds the route of a request; 404 for an unknown path, 405 for a wrong method."""

    def __init__(self, routes: Sequence[Route]) -> None:
        self.routes = list(routes)
        self._by_path: dict[str, dict[str, Route]] = {}
        for route in routes:
            self._by_path.setdefault(route.path, {})[route.method] = route

    def routes_at(self, path: str) -> list[Route]:
        """The routes of an exact path (any method); [] for an unknown path."""
        return list(self._by_path.get(path, {}).values())

    def methods(self, path: str) -> list[str]:
        return sorted(self._by_path.get(path, {}))

    def match(self, method: str, path: str) -> Route:
        """The route for (method, path). Raises APIError(404) or APIError(405)."""
        by_method = self._by_path.get(path)
        if by_method is None:
            raise APIError(
                404,
                f"no route {method} {path}; /openapi.json lists the routes",
                type="invalid_request_error",
                code="not_found",
            )
        route = by_method.get(method)
        if route is None:
            allowed = ", ".join(self.methods(path))
            raise APIError(
                405,
                f"{path} does not accept {method}; use {allowed}",
                code="method_not_allowed",
                headers={"allow": allowed},
            )
        return route
