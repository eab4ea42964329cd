"""`flowengine serve [MODEL]`: the OpenAI-compatible server on Hypercorn and uvloop.

Start-up order (what systemd's `Type=notify` relies on): load the engine (weights,
KV cache) → bind and listen on the socket → `READY=1` when Hypercorn's lifespan
startup completes (it accepts from the already-listening socket right after).

Shutdown on SIGTERM/SIGINT: `STOPPING=1`, new requests get 503 (with `Retry-After`),
in-flight requests and streams run to completion for at most `--graceful-timeout`
seconds (streams still open then are cancelled, which aborts their requests), then
Hypercorn closes its sockets, `engine.shutdown()` runs, and the process exits 0. A
second signal skips the rest of the drain.

Test-only: `FLOWENGINE_TEST_ENGINE=module:callable` makes the server call
`callable(engine_args)` for its `EngineClient` instead of building `AsyncEngine`; the
tests use it to serve a deterministic fake engine from a subprocess. It is logged as a
warning and is not meant for deployments.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from flowengine.config import EngineArgs
from flowengine.engine.protocol import EngineClient, EngineDeadError
from flowengine.entrypoints.cli_args import add_engine_args, engine_args_from
from flowengine.entrypoints.openai.app import DEFAULT_MAX_REQUEST_BODY_BYTES, AppOptions
from flowengine.entrypoints.openai.hypercorn_server import APIServer
from flowengine.entrypoints.openai.notify import sd_notify

logger = logging.getLogger("flowengine.entrypoints.openai.server")

TEST_ENGINE_ENV = "FLOWENGINE_TEST_ENGINE"
API_KEY_ENVS = ("FLOWENGINE_API_KEY", "VLLM_API_KEY")
# Seconds the engine may take to stop after the HTTP drain (it has nothing left to run
# unless the drain timed out, in which case the cancelled requests were aborted).
ENGINE_SHUTDOWN_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ServerOptions:
    """Where and how to serve (everything that is not an engine argument).

    Attributes:
        host, port: listening address (port 0 picks a free port; the log names it).
        app: HTTP-level options (API key, CORS, body limit).
        max_queue_len: most requests waiting for their first token; more get 429.
        graceful_timeout_s: longest drain after SIGTERM, in seconds.
        log_requests: one INFO line per generation request (ids, counts, timings).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    app: AppOptions = AppOptions()
    max_queue_len: int | None = None
    graceful_timeout_s: float = 120.0
    log_requests: bool = True


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="flowengine serve",
        description="OpenAI-compatible HTTP server (Hypercorn, uvloop).",
    )
    add_engine_args(p)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="listen address (0.0.0.0: all IPv4)")
    s.add_argument("--port", type=int, default=8000, help="listen port (0: any free port)")
    s.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on /v1 and tokenizer routes "
        f"(default: ${API_KEY_ENVS[0]} or ${API_KEY_ENVS[1]}; prefer the environment, "
        "command lines are visible to other users)",
    )
    s.add_argument(
        "--allowed-origins",
        nargs="+",
        default=[],
        help="CORS origins allowed from browsers, e.g. https://app.example '*' "
        "(vLLM's JSON list form '[\"*\"]' works too; default: none)",
    )
    s.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error", "critical"],
    )
    s.add_argument("--disable-log-requests", action="store_true", help="no INFO line per request")
    s.add_argument(
        "--max-queue-len",
        type=int,
        default=None,
        help="requests waiting for their first token before new ones get 429 (default: no limit)",
    )
    s.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="larger request bodies get 413",
    )
    s.add_argument(
        "--graceful-timeout",
        type=float,
        default=120.0,
        help="seconds in-flight requests may run after SIGTERM (long streams need minutes)",
    )
    return p


def _origins(values: list[str]) -> tuple[str, ...]:
    import orjson

    if len(values) == 1 and values[0].lstrip().startswith("["):
        return tuple(str(v) for v in orjson.loads(values[0]))
    return tuple(values)


def options_from(ns: argparse.Namespace) -> ServerOptions:
    """ServerOptions from parsed flags. Raises ValueError for invalid values."""
    if ns.max_queue_len is not None and ns.max_queue_len < 1:
        raise ValueError(f"--max-queue-len must be >= 1, got {ns.max_queue_len}")
    if ns.max_request_body_bytes < 1:
        raise ValueError(f"--max-request-body-bytes must be >= 1, got {ns.max_request_body_bytes}")
    if ns.graceful_timeout < 0:
        raise ValueError(f"--graceful-timeout must be >= 0, got {ns.graceful_timeout}")
    api_key = ns.api_key
    for env in API_KEY_ENVS:
        api_key = api_key or os.environ.get(env) or None
    return ServerOptions(
        host=ns.host,
        port=ns.port,
        app=AppOptions(
            api_key=api_key,
            allowed_origins=_origins(ns.allowed_origins),
            max_request_body_bytes=ns.max_request_body_bytes,
        ),
        max_queue_len=ns.max_queue_len,
        graceful_timeout_s=ns.graceful_timeout,
        log_requests=not ns.disable_log_requests,
    )


def create_engine(args: EngineArgs) -> EngineClient:
    """The engine to serve: `AsyncEngine`, or the test hook's (see module docstring)."""
    hook = os.environ.get(TEST_ENGINE_ENV)
    if hook:
        logger.warning("%s=%s: serving a TEST engine, not a model", TEST_ENGINE_ENV, hook)
        module_name, _, attr = hook.partition(":")
        factory: Callable[[EngineArgs], EngineClient] = getattr(
            importlib.import_module(module_name), attr
        )
        return factory(args)
    from flowengine.entrypoints.async_engine import AsyncEngine

    return AsyncEngine.from_engine_args(args)


def bind_socket(host: str, port: int, backlog: int) -> socket.socket:
    """A listening TCP socket. Raises OSError (address in use, bad host)."""
    family, type_, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, type_, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Inherited by accepted connections: SSE events go out at once, not after Nagle.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind(address)
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


async def serve(engine_args: EngineArgs, options: ServerOptions) -> int:
    """Load the engine, serve until SIGTERM/SIGINT, drain, stop. Returns the exit code."""
    sd_notify("STATUS=loading the model")
    t0 = time.monotonic()
    try:
        engine = create_engine(engine_args)
        started = getattr(engine, "start", lambda: None)()
        if inspect.isawaitable(started):
            await started
    except (ValueError, TypeError, OSError, EngineDeadError) as err:
        logger.error("cannot start the engine: %s", err)
        return 1
    logger.info("engine %s ready in %.1f s", engine.model_name, time.monotonic() - t0)
    # An engine that can no longer serve ends the process with exit code 1, so a service
    # manager (systemd Restart=on-failure) restarts it, instead of answering 503 forever.
    engine_died: list[BaseException] = []
    server: APIServer | None = None

    def on_engine_dead(err: BaseException) -> None:
        logger.error("the engine cannot serve any more (%s); exiting with code 1", err)
        engine_died.append(err)
        if server is not None:
            asyncio.get_running_loop().call_soon(server.begin_shutdown)

    add_dead_callback = getattr(engine, "add_dead_callback", None)
    if add_dead_callback is not None:
        add_dead_callback(on_engine_dead)
    try:
        try:
            sock = bind_socket(options.host, options.port, APIServer.BACKLOG)
        except OSError as err:
            logger.error("cannot listen on %s:%d: %s", options.host, options.port, err)
            return 1
        host, port = sock.getsockname()[:2]
        names = engine_args.served_model_name or (engine.model_name,)

        def ready() -> None:
            logger.info("serving %s on http://%s:%d", ", ".join(names), host, port)
            sd_notify(f"READY=1\nSTATUS=serving on {host}:{port}")

        server = APIServer(
            engine,
            model_names=names,
            app_options=replace(options.app, on_startup=(ready,)),
            max_queue_len=options.max_queue_len,
            graceful_timeout_s=options.graceful_timeout_s,
        )
        if not engine_died:
            await server.serve(sock, install_signal_handlers=True)
    finally:
        await engine.shutdown(drain_timeout_s=ENGINE_SHUTDOWN_TIMEOUT_S)
    if engine_died:
        return 1
    logger.info("stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of `flowengine serve`; returns the process exit code."""
    ns = make_parser().parse_args(argv)
    logging.basicConfig(
        level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        options = options_from(ns)
        engine_args = engine_args_from(ns)
    except (ValueError, TypeError) as err:
        logger.error("%s", err)
        return 2
    if not options.log_requests:
        logging.getLogger("flowengine.entrypoints.openai.requests").setLevel(logging.WARNING)
    # Until the event loop installs its handlers (after loading), Ctrl-C just ends the
    # process: there is nothing to drain yet, and no KeyboardInterrupt traceback.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        import uvloop
    except ImportError:  # uvloop has no Windows build
        return asyncio.run(serve(engine_args, options))
    return uvloop.run(serve(engine_args, options))
