"""The gRPC server: service `flowengine.v1.Generate` and `grpc.health.v1.Health`.

Runs on the same event loop, engine and admission limit as the HTTP server
(`flowengine serve --grpc-port N`), through grpc.aio. Each call is one engine request
(`EngineClient.submit`); when the client cancels the call (or its deadline passes),
grpc.aio cancels the handler task, which closes the engine stream and aborts the
request, freeing its KV blocks. Errors become status codes (the .proto's header lists
them); the message says what to change. The health service reports SERVING while the
engine serves and NOT_SERVING once it cannot (checked every `health_interval_s`) or the
server drains.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from flowengine.engine.protocol import EngineClient, EngineDeadError, EngineOverloadedError
from flowengine.entrypoints.grpc import generate_pb2 as pb
from flowengine.entrypoints.grpc import generate_pb2_grpc as pb_grpc
from flowengine.entrypoints.openai.app import bearer_matches
from flowengine.entrypoints.openai.errors import APIError
from flowengine.entrypoints.openai.generation import Admission, engine_error
from flowengine.entrypoints.openai.sampling import (
    RequestLimits,
    capped_max_tokens,
    check_limits,
)
from flowengine.errors import RequestValidationError
from flowengine.messages import REQUEST_ERROR_PREFIX, is_request_error
from flowengine.net import host_port
from flowengine.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

SERVICE_NAME = "flowengine.v1.Generate"
# SamplingParams fields the proto carries as proto3 `optional` scalars (set or not).
_OPTIONAL_FIELDS = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "min_tokens",
                    "seed", "repetition_penalty", "presence_penalty", "frequency_penalty",
                    "skip_special_tokens")
# max_tokens of a call that leaves it unset: /v1/completions' default (OpenAI's and
# vLLM's, protocol.CompletionRequest), capped by the model's max_new_tokens as there.
DEFAULT_MAX_TOKENS = 16
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty")


class GrpcError(Exception):
    """A status the handler ends the call with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def sampling_params_from(msg: pb.SamplingParams, defaults: dict[str, Any]) -> SamplingParams:
    """SamplingParams of a request: its set fields over the model's defaults
    (generation_config.json), as the HTTP routes do. `max_tokens` follows
    /v1/completions: 16 when unset, and the model's max_new_tokens (defaults'
    "max_tokens") caps it rather than replacing it (capped_max_tokens). Raises
    ValueError/TypeError for invalid values (SamplingParams validates)."""
    kwargs = dict(defaults)
    for name in _OPTIONAL_FIELDS:
        if msg.HasField(name):
            value = getattr(msg, name)
            # float32 on the wire: round to the nearest short decimal (0.7, not
            # 0.699999988079071), so a value means what the client wrote.
            kwargs[name] = float(f"{value:.7g}") if name in _FLOAT_FIELDS else value
    requested = msg.max_tokens if msg.HasField("max_tokens") else DEFAULT_MAX_TOKENS
    kwargs["max_tokens"] = capped_max_tokens(requested, defaults)
    if msg.stop:
        kwargs["stop"] = list(msg.stop)
    if msg.stop_token_ids:
        kwargs["stop_token_ids"] = list(msg.stop_token_ids)
    if msg.ignore_eos:
        kwargs["ignore_eos"] = True
    return SamplingParams(**kwargs)


def _usage(out: Any, num_generated: int) -> pb.Usage:
    return pb.Usage(prompt_tokens=len(out.prompt_token_ids), completion_tokens=num_generated,
                    cached_tokens=out.num_cached_tokens)


def _set_stop_reason(resp: pb.GenerateResponse, stop_reason: int | str | None) -> None:
    if isinstance(stop_reason, str):
        resp.stop_string = stop_reason
    elif isinstance(stop_reason, int):
        resp.stop_token_id = stop_reason


class GenerateServicer(pb_grpc.GenerateServicer):
    """The `flowengine.v1.Generate` handlers over one engine.

    Args:
        engine: the EngineClient (the one the HTTP routes use).
        model_names: names a request's `model` may use; the first is the default.
        admission: the HTTP server's queue limit, shared (requests waiting for their
            first output, both front doors together).
        limits: the HTTP server's per-request limits (`--max-request-tokens`), checked
            as the HTTP routes check them.
        api_key: the HTTP server's `--api-key`: if set, calls must carry the metadata
            `authorization: Bearer <key>` (HTTP's header), else UNAUTHENTICATED.
    """

    def __init__(self, engine: EngineClient, model_names: tuple[str, ...],
                 admission: Admission, limits: RequestLimits | None = None,
                 api_key: str | None = None) -> None:
        self.engine = engine
        self.model_names = model_names
        self.admission = admission
        self.limits = limits or RequestLimits()
        self.api_key = api_key
        self.draining = False

    async def Generate(self, request: pb.GenerateRequest, context: Any) -> pb.GenerateResponse:
        rid = ""
        text: list[str] = []
        token_ids: list[int] = []
        last = None
        try:
            self._check_api_key(context)
            async for req_id, out in self._outputs(request):
                rid = req_id
                completion = out.outputs[0]
                text.append(completion.text)
                token_ids += completion.token_ids
                last = out
        except GrpcError as err:
            await context.abort(err.code, err.message)
        assert last is not None
        completion = last.outputs[0]
        resp = pb.GenerateResponse(request_id=rid, text="".join(text), token_ids=token_ids,
                                   finish_reason=completion.finish_reason or "",
                                   usage=_usage(last, len(token_ids)))
        _set_stop_reason(resp, completion.stop_reason)
        return resp

    async def GenerateStream(self, request: pb.GenerateRequest, context: Any
                             ) -> AsyncIterator[pb.GenerateResponse]:
        num_generated = 0
        try:
            self._check_api_key(context)
            async for rid, out in self._outputs(request):
                completion = out.outputs[0]
                num_generated += len(completion.token_ids)
                resp = pb.GenerateResponse(request_id=rid, text=completion.text,
                                           token_ids=completion.token_ids,
                                           finish_reason=completion.finish_reason or "")
                if out.finished:
                    resp.usage.CopyFrom(_usage(out, num_generated))
                    _set_stop_reason(resp, completion.stop_reason)
                yield resp
        except GrpcError as err:
            await context.abort(err.code, err.message)

    def _check_api_key(self, context: Any) -> None:
        """Raise GrpcError(UNAUTHENTICATED) unless the call carries the server's key as
        the metadata `authorization: Bearer <key>` (compared in constant time)."""
        if self.api_key is None:
            return
        metadata = dict(context.invocation_metadata() or ())
        if bearer_matches(str(metadata.get("authorization", "")), self.api_key):
            return
        raise GrpcError(grpc.StatusCode.UNAUTHENTICATED,
                        "invalid or missing API key; send the metadata "
                        "'authorization: Bearer <key>'")

    async def _outputs(self, request: pb.GenerateRequest) -> AsyncIterator[tuple[str, Any]]:
        """(request id, RequestOutput delta) of the request until it finishes. Raises
        GrpcError. Closing this iterator (the call was cancelled) aborts the request."""
        if self.draining:
            raise GrpcError(grpc.StatusCode.UNAVAILABLE,
                            "the server is shutting down; send the request to another replica")
        if request.model and request.model not in self.model_names:
            raise GrpcError(grpc.StatusCode.NOT_FOUND,
                            f"the model {request.model!r} does not exist; this server serves "
                            f"{', '.join(repr(n) for n in self.model_names)}")
        which = request.WhichOneof("prompt")
        if which is None:
            raise GrpcError(grpc.StatusCode.INVALID_ARGUMENT,
                            "the request has no prompt: set text or token_ids")
        prompt: str | list[int] = (request.text if which == "text"
                                   else list(request.token_ids.ids))
        try:
            params = sampling_params_from(request.sampling_params,
                                          self.engine.default_sampling_params)
        except (ValueError, TypeError) as err:
            raise GrpcError(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from err
        if params.n != 1:
            raise GrpcError(grpc.StatusCode.INVALID_ARGUMENT, "n must be 1")
        try:
            check_limits(self.limits, params, 1, self.engine.max_model_len)
        except APIError as err:
            raise GrpcError(grpc.StatusCode.INVALID_ARGUMENT, err.message) from err
        rid = request.request_id or f"grpc-{uuid.uuid4().hex}"
        try:
            self.admission.enter()
        except APIError as err:
            raise GrpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, err.message) from err
        pending = True
        stream = self.engine.submit(prompt, params, rid, priority=request.priority,
                                    output_kind=RequestOutputKind.DELTA)
        try:
            async for out in stream:
                if pending:
                    self.admission.leave()
                    pending = False
                if out.error:
                    if is_request_error(out.error):
                        raise GrpcError(grpc.StatusCode.INVALID_ARGUMENT,
                                        out.error.removeprefix(REQUEST_ERROR_PREFIX))
                    raise GrpcError(grpc.StatusCode.INTERNAL,
                                    f"the request failed in the engine: {out.error}")
                yield rid, out
        except RequestValidationError as err:
            raise GrpcError(grpc.StatusCode.INVALID_ARGUMENT, str(err)) from err
        except EngineOverloadedError as err:
            raise GrpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err)) from err
        except EngineDeadError as err:
            raise GrpcError(grpc.StatusCode.UNAVAILABLE,
                            f"the engine is not running: {err}") from err
        except GrpcError:
            raise
        except Exception as err:  # a failure of the server's own: logged, never sent
            raise GrpcError(grpc.StatusCode.INTERNAL, engine_error(err).message) from err
        finally:
            if pending:
                self.admission.leave()
            await stream.aclose()  # an unfinished stream aborts its engine request


class GrpcServer:
    """`flowengine.v1.Generate` + `grpc.health.v1.Health` on `host:port`.

    Args:
        engine, model_names, admission, limits, api_key: as GenerateServicer.
        host, port: where to listen (port 0: a free port; `port` holds it after start).
        health_interval_s: how often the health status is refreshed from the engine.
    """

    def __init__(self, engine: EngineClient, model_names: tuple[str, ...], admission: Admission,
                 host: str = "127.0.0.1", port: int = 0, health_interval_s: float = 1.0,
                 limits: RequestLimits | None = None, api_key: str | None = None) -> None:
        self.engine = engine
        self.servicer = GenerateServicer(engine, model_names, admission, limits, api_key)
        self.health = health.aio.HealthServicer()
        self.host = host
        self.port = port
        self.health_interval_s = health_interval_s
        self._server: grpc.aio.Server | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._draining_task: asyncio.Task[None] | None = None

    async def start(self) -> int:
        """Listen and serve; returns the port. Raises OSError if it cannot bind."""
        server = grpc.aio.server()
        pb_grpc.add_GenerateServicer_to_server(self.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        address = host_port(self.host, self.port)
        try:
            port = server.add_insecure_port(address)
        except RuntimeError as err:
            raise OSError(f"cannot listen on {address} for gRPC: {err}") from err
        if port == 0:
            raise OSError(f"cannot listen on {address} for gRPC (address in use?)")
        self.port = port
        await server.start()
        self._server = server
        await self._refresh_health()
        self._health_task = asyncio.get_running_loop().create_task(self._watch_health())
        logger.info("serving gRPC %s on %s:%d", SERVICE_NAME, self.host, port)
        return port

    async def _refresh_health(self) -> None:
        status = health_pb2.HealthCheckResponse.SERVING
        if self.servicer.draining:
            status = health_pb2.HealthCheckResponse.NOT_SERVING
        else:
            try:
                await self.engine.check_health()  # type: ignore[attr-defined]
            except Exception:  # noqa: BLE001 - any failure means "not serving"
                status = health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", SERVICE_NAME):
            await self.health.set(service, status)

    async def _watch_health(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            await self._refresh_health()

    def start_draining(self) -> None:
        """Refuse new calls (UNAVAILABLE) and report NOT_SERVING from now on, as the HTTP
        server does while it drains; running calls go on until `stop`. Call on the
        server's loop."""
        self.servicer.draining = True
        if self._server is not None and self._draining_task is None:
            # Now, not at the health watcher's next refresh.
            self._draining_task = asyncio.get_running_loop().create_task(self._refresh_health())

    async def stop(self, grace_s: float | None = 5.0) -> None:
        """Refuse new calls, let running ones finish for up to `grace_s`, then cancel
        the rest (their engine requests are aborted)."""
        self.servicer.draining = True
        if self._draining_task is not None:
            await self._draining_task
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        if self._server is not None:
            with contextlib.suppress(Exception):
                await self.health.enter_graceful_shutdown()
            start = time.monotonic()
            await self._server.stop(grace_s)
            logger.info("gRPC server stopped in %.1f s", time.monotonic() - start)
            self._server = None
