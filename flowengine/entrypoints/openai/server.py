"""`flowengine serve [MODEL]`: the OpenAI-compatible server on Hypercorn and uvloop.

Start-up order (what systemd's `Type=notify` relies on): load the engine (weights,
KV cache) → bind and listen on the socket → `READY=1` when Hypercorn's lifespan
startup completes (it accepts from the already-listening socket right after).

Shutdown on SIGTERM/SIGINT: `STOPPING=1`, new requests get 503 (with `Retry-After`),
in-flight requests and streams run to completion for at most `--graceful-timeout`
seconds (streams still open then end with an error event and `data: [DONE]`,
unanswered requests get 503, and their engine requests are aborted), then
Hypercorn closes its sockets, `engine.shutdown()` runs, and the process exits 0. A
second signal skips the rest of the drain.

Exit codes (what the systemd unit's `Restart=`/`RestartPreventExitStatus=` rely on):
0 after a drained stop; EXIT_CONFIG_ERROR (2, argparse's) when the configuration is
wrong before anything loads (a bad flag or value, a model path that does not exist,
a --chat-template that does not open or is not valid Jinja);
1 for everything a restart may cure (the engine failed to load or died, the port is
taken).

Test-only: `FLOWENGINE_TEST_ENGINE=module:callable` makes the server call
`callable(engine_args)` for its `EngineClient` instead of building `AsyncEngine`; the
tests use it to serve a deterministic fake engine from a subprocess. It is logged as a
warning and is not meant for deployments.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import inspect
import logging
import os
import signal
import socket
import ssl
import stat
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from flowengine.config import EngineArgs
from flowengine.core.admission import default_max_queue_len
from flowengine.engine.protocol import EngineClient, EngineDeadError
from flowengine.entrypoints.cli_args import add_engine_args, engine_args_from
from flowengine.entrypoints.openai.app import (
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    DEFAULT_REQUEST_BODY_TIMEOUT_S,
    AppOptions,
    load_middleware,
)
from flowengine.entrypoints.openai.chat_parsing import ChatParsingOptions
from flowengine.entrypoints.openai.hypercorn_server import APIServer
from flowengine.entrypoints.openai.notify import sd_notify
from flowengine.entrypoints.openai.responses_store import DEFAULT_MAX_BYTES, DEFAULT_MAX_ENTRIES
from flowengine.entrypoints.openai.sampling import DEFAULT_MAX_N, RequestLimits
from flowengine.model.errors import ModelDownloadError
from flowengine.net import host_port

logger = logging.getLogger("flowengine.entrypoints.openai.server")

TEST_ENGINE_ENV = "FLOWENGINE_TEST_ENGINE"
# Exit status for a wrong configuration, argparse's own: restarting cannot cure it
# (examples/systemd/flowengine.service lists it in RestartPreventExitStatus=).
EXIT_CONFIG_ERROR = 2
API_KEY_ENVS = ("FLOWENGINE_API_KEY", "VLLM_API_KEY")
# Seconds the engine may take to stop after the HTTP drain (it has nothing left to run
# unless the drain timed out, in which case the cancelled requests were aborted).
ENGINE_SHUTDOWN_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class ServerOptions:
    """Where and how to serve (everything that is not an engine argument).

    Attributes:
        host, port: listening address (port 0 picks a free port; the log names it).
        uds: listen on this Unix domain socket path instead (host and port ignored).
        app: HTTP-level options (API key, CORS, body limits, middleware, root path).
        max_queue_len: most requests waiting for their first token; more get 429.
            None: `default_max_queue_len(max_num_seqs, KV blocks)` once the engine
            is loaded (flowengine/core/admission.py).
        graceful_timeout_s: longest drain after SIGTERM, in seconds.
        log_requests: one INFO line per generation request (ids, counts, timings).
        max_n: most completions per prompt; None: min(DEFAULT_MAX_N, max_num_seqs).
        max_request_tokens: most tokens one request may ask for (n x max_tokens).
        header_timeout_s: seconds for a request's headers (and idle keep-alive).
        ssl_certfile, ssl_keyfile: HTTPS with these PEM files.
        enable_prompt_tokens_details: usage gets `prompt_tokens_details.cached_tokens`
            (prompt tokens served from the prefix cache), as vLLM's flag.
        trust_request_chat_template: accept a chat request's own `chat_template`.
        chat_parsing: tool-call and reasoning parsing of chat outputs (the
            --tool-call-parser, --enable-auto-tool-choice, --reasoning-parser flags).
        grpc_port: also serve gRPC on this port (process 0 only).
        api_server_count: HTTP frontend processes on the one socket (vLLM's flag):
            each tokenizes, detokenizes and streams its own connections' requests
            into the one engine (flowengine/entrypoints/openai/api_servers.py).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    uds: str | None = None
    app: AppOptions = AppOptions()
    max_queue_len: int | None = None
    graceful_timeout_s: float = 120.0
    log_requests: bool = True
    max_n: int | None = None
    max_request_tokens: int | None = None
    header_timeout_s: float = 5.0
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    enable_prompt_tokens_details: bool = False
    trust_request_chat_template: bool = False
    chat_parsing: ChatParsingOptions = ChatParsingOptions()
    grpc_port: int | None = None
    api_server_count: int = 1


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
        help=f"require 'Authorization: Bearer KEY' on /v1 and tokenizer routes and gRPC calls "
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
        "--allowed-methods",
        nargs="+",
        default=["*"],
        help="CORS methods a preflight may ask for ('*': those the path accepts)",
    )
    s.add_argument(
        "--allowed-headers",
        nargs="+",
        default=["*"],
        help="CORS request headers a preflight may ask for ('*': any)",
    )
    s.add_argument(
        "--allow-credentials", action="store_true", help="CORS: allow credentials (cookies)"
    )
    s.add_argument("--uds", default=None, help="listen on this Unix domain socket (not TCP)")
    s.add_argument(
        "--root-path",
        default="",
        help="path prefix stripped by a path-based reverse proxy, e.g. /llm",
    )
    s.add_argument("--ssl-keyfile", default=None, help="HTTPS: the private key (PEM)")
    s.add_argument("--ssl-certfile", default=None, help="HTTPS: the certificate chain (PEM)")
    s.add_argument(
        "--middleware",
        action="append",
        default=[],
        help="import path of an ASGI middleware class or an 'async def f(request, "
        "call_next)' function, applied to every request (repeatable, first outermost)",
    )
    s.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error", "critical"],
    )
    s.add_argument("--disable-log-requests", action="store_true", help="no INFO line per request")
    s.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="usage.prompt_tokens_details.cached_tokens: prompt tokens served from the "
        "prefix cache",
    )
    s.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="accept a chat request's own chat_template (a Jinja template the server "
        "renders, sandboxed); without it such a request gets 400",
    )
    add_chat_parsing_args(p)
    s.add_argument(
        "--max-queue-len",
        type=int,
        default=None,
        help="requests waiting for their first token before new ones get 429 with "
        "Retry-After (default: 2 x min(max_num_seqs, KV cache blocks))",
    )
    s.add_argument(
        "--max-n",
        type=int,
        default=None,
        help=f"most completions per prompt (n); default min({DEFAULT_MAX_N}, --max-num-seqs)",
    )
    s.add_argument(
        "--max-request-tokens",
        type=int,
        default=None,
        help="most tokens one request may ask to generate, prompts x n x max_tokens "
        "(default: no limit beyond --max-n)",
    )
    s.add_argument(
        "--request-body-timeout",
        type=float,
        default=DEFAULT_REQUEST_BODY_TIMEOUT_S,
        help="seconds a request body may take to arrive before 408 (0: no limit)",
    )
    s.add_argument(
        "--header-timeout",
        type=float,
        default=5.0,
        help="seconds a connection may take to send a request's headers, also the "
        "idle keep-alive time",
    )
    s.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="larger request bodies get 413",
    )
    s.add_argument(
        "--responses-store-max",
        type=int,
        default=DEFAULT_MAX_ENTRIES,
        help="responses the Responses API keeps in memory for GET /v1/responses/{id} and "
        "previous_response_id, least recently used dropped first (0: store none)",
    )
    s.add_argument(
        "--responses-store-max-bytes",
        type=int,
        default=DEFAULT_MAX_BYTES,
        help="bytes of text those stored responses may hold in all",
    )
    s.add_argument(
        "--graceful-timeout",
        type=float,
        default=120.0,
        help="seconds in-flight requests may run after SIGTERM (long streams need minutes)",
    )
    s.add_argument(
        "--api-server-count",
        "-asc",
        type=int,
        default=1,
        help="HTTP frontend processes sharing the listening socket and the one engine "
        "(each takes its own connections: tokenizing, detokenizing and streaming spread "
        "over cores); needs the multiproc placement, which it then selects",
    )
    s.add_argument(
        "--grpc-port",
        type=int,
        default=None,
        help="also serve gRPC (service flowengine.v1.Generate, proto/flowengine/v1/"
        "generate.proto, and grpc.health.v1) on this port of --host, on the same engine "
        "and limits as HTTP (needs the 'grpc' extra: pip install flowengine[grpc])",
    )
    return p


def add_chat_parsing_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's tool-calling and reasoning flags (flowengine/entrypoints/openai/chat_parsing.py)."""
    from flowengine.entrypoints.openai.tool_parsers import TOOL_PARSERS
    from flowengine.reasoning import REASONING_PARSERS

    g = parser.add_argument_group("tool calling and reasoning")
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="parse tool calls out of the model's text for tool_choice 'auto' (the default "
        "when a request has tools); needs --tool-call-parser. Without it such requests get 400",
    )
    g.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_PARSERS),
        help="the model's tool-call format: hermes (<tool_call> JSON, Qwen2.5/Qwen3, "
        "examples/templates/tool_chat_template_hermes.jinja), llama3_json, mistral, pythonic",
    )
    g.add_argument(
        "--exclude-tools-when-tool-choice-none",
        action="store_true",
        help="with tool_choice 'none', render the chat template without the tools",
    )
    g.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_PARSERS),
        help="split <think>...</think> reasoning into reasoning_content: qwen3, deepseek_r1",
    )


def _origins(flag: str, values: list[str]) -> tuple[str, ...]:
    """The values of a CORS flag, also as vLLM's one JSON list. Raises ValueError."""
    import orjson

    if len(values) == 1 and values[0].lstrip().startswith("["):
        try:
            return tuple(str(v) for v in orjson.loads(values[0]))
        except orjson.JSONDecodeError as err:
            raise ValueError(f"{flag} {values[0]!r} is not a JSON list: {err}") from None
    return tuple(values)


def options_from(ns: argparse.Namespace) -> ServerOptions:
    """ServerOptions from parsed flags. Raises ValueError for invalid values."""
    # NOTE: checked here, not left to bind(): the OS takes a port above 65535 modulo
    # 65536 (70000 listened on 4464).
    if not 0 <= ns.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {ns.port}")
    if ns.max_queue_len is not None and ns.max_queue_len < 1:
        raise ValueError(f"--max-queue-len must be >= 1, got {ns.max_queue_len}")
    if ns.max_request_body_bytes < 1:
        raise ValueError(f"--max-request-body-bytes must be >= 1, got {ns.max_request_body_bytes}")
    if ns.graceful_timeout < 0:
        raise ValueError(f"--graceful-timeout must be >= 0, got {ns.graceful_timeout}")
    for flag, value in (("--max-n", ns.max_n), ("--max-request-tokens", ns.max_request_tokens)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    for flag, value in (
        ("--responses-store-max", ns.responses_store_max),
        ("--responses-store-max-bytes", ns.responses_store_max_bytes),
    ):
        if value < 0:
            raise ValueError(f"{flag} must be >= 0, got {value}")
    if ns.request_body_timeout < 0:
        raise ValueError(f"--request-body-timeout must be >= 0, got {ns.request_body_timeout}")
    if ns.api_server_count < 1:
        raise ValueError(f"--api-server-count must be >= 1, got {ns.api_server_count}")
    if ns.header_timeout <= 0:
        raise ValueError(f"--header-timeout must be > 0, got {ns.header_timeout}")
    if (ns.ssl_keyfile is None) != (ns.ssl_certfile is None):
        raise ValueError("HTTPS needs both --ssl-keyfile and --ssl-certfile")
    if ns.ssl_certfile is not None:
        try:  # fail at start-up, with the file named, not at the first connection
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
                ns.ssl_certfile, ns.ssl_keyfile
            )
        except (OSError, ssl.SSLError) as err:
            raise ValueError(
                f"cannot load --ssl-certfile {ns.ssl_certfile!r} / --ssl-keyfile "
                f"{ns.ssl_keyfile!r}: {err}"
            ) from err
    if ns.root_path and not ns.root_path.startswith("/"):
        raise ValueError(f"--root-path must start with '/', got {ns.root_path!r}")
    for path in ns.middleware:
        load_middleware(path)  # raises ValueError naming a path that does not import
    chat_parsing = ChatParsingOptions(  # raises ValueError: auto tool choice, no parser
        tool_call_parser=ns.tool_call_parser,
        enable_auto_tool_choice=ns.enable_auto_tool_choice,
        reasoning_parser=ns.reasoning_parser,
        exclude_tools_when_tool_choice_none=ns.exclude_tools_when_tool_choice_none,
    )
    api_key = ns.api_key
    for env in API_KEY_ENVS:
        api_key = api_key or os.environ.get(env) or None
    return ServerOptions(
        host=ns.host,
        port=ns.port,
        uds=ns.uds,
        app=AppOptions(
            api_key=api_key,
            allowed_origins=_origins("--allowed-origins", ns.allowed_origins),
            allowed_methods=_origins("--allowed-methods", ns.allowed_methods),
            allowed_headers=_origins("--allowed-headers", ns.allowed_headers),
            allow_credentials=ns.allow_credentials,
            max_request_body_bytes=ns.max_request_body_bytes,
            request_body_timeout_s=ns.request_body_timeout or None,
            middleware=tuple(ns.middleware),
            root_path=ns.root_path.rstrip("/"),
            responses_store_max=ns.responses_store_max,
            responses_store_max_bytes=ns.responses_store_max_bytes,
        ),
        max_queue_len=ns.max_queue_len,
        graceful_timeout_s=ns.graceful_timeout,
        log_requests=not ns.disable_log_requests,
        max_n=ns.max_n,
        max_request_tokens=ns.max_request_tokens,
        header_timeout_s=ns.header_timeout,
        ssl_certfile=ns.ssl_certfile,
        ssl_keyfile=ns.ssl_keyfile,
        enable_prompt_tokens_details=ns.enable_prompt_tokens_details,
        trust_request_chat_template=ns.trust_request_chat_template,
        chat_parsing=chat_parsing,
        grpc_port=_grpc_port(ns.grpc_port),
        api_server_count=ns.api_server_count,
    )


def _grpc_port(port: int | None) -> int | None:
    """--grpc-port, checked (ValueError) with grpcio importable (the 'grpc' extra)."""
    if port is None:
        return None
    if not 0 <= port <= 65535:
        raise ValueError(f"--grpc-port must be in [0, 65535], got {port}")
    try:
        import flowengine.entrypoints.grpc.server  # noqa: F401
    except ImportError as err:
        raise ValueError(f"--grpc-port needs grpcio ({err}); install the 'grpc' extra: "
                         "pip install 'flowengine[grpc]'") from err
    return port


def create_engine(args: EngineArgs, api_server_count: int = 1) -> EngineClient:
    """The engine to serve: `AsyncEngine`, or the test hook's (see module docstring).
    Raises ValueError for the test hook with api_server_count > 1."""
    hook = os.environ.get(TEST_ENGINE_ENV)
    if hook and api_server_count > 1:
        raise ValueError(f"{TEST_ENGINE_ENV} serves one process; --api-server-count must be 1")
    if hook:
        logger.warning("%s=%s: serving a TEST engine, not a model", TEST_ENGINE_ENV, hook)
        module_name, _, attr = hook.partition(":")
        factory: Callable[[EngineArgs], EngineClient] = getattr(
            importlib.import_module(module_name), attr
        )
        return factory(args)
    from flowengine.entrypoints.async_engine import AsyncEngine

    return AsyncEngine.from_engine_args(args, api_server_count=api_server_count)


def bind_unix_socket(path: str, backlog: int) -> socket.socket:
    """A listening Unix domain socket at `path` (a stale socket file there is replaced;
    any other file is an error). Raises OSError."""
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISSOCK(os.stat(path).st_mode):
            raise OSError(f"{path} exists and is not a socket; choose another --uds path")
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


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


def resolve_max_queue_len(engine: EngineClient, engine_args: EngineArgs,
                          options: ServerOptions) -> int:
    """--max-queue-len, or its default from the loaded engine's KV cache size."""
    if options.max_queue_len is not None:
        return options.max_queue_len
    num_blocks = engine.get_stats().num_total_blocks
    max_queue_len = default_max_queue_len(engine_args.max_num_seqs, num_blocks)
    logger.info(
        "max_queue_len %d (2 x min(max_num_seqs %d, KV blocks %s); --max-queue-len "
        "sets it)", max_queue_len, engine_args.max_num_seqs, num_blocks or "unknown",
    )  # fmt: skip
    return max_queue_len


def build_api_server(engine: EngineClient, engine_args: EngineArgs, options: ServerOptions,
                     max_queue_len: int, on_startup: Callable[[], None]) -> APIServer:
    """The HTTP server of one frontend process over `engine` (every API server process
    builds the same one from the same flags)."""
    limits = RequestLimits(
        max_n=options.max_n or min(DEFAULT_MAX_N, engine_args.max_num_seqs),
        max_logprobs=engine_args.max_logprobs,
        max_request_tokens=options.max_request_tokens,
    )
    return APIServer(
        engine,
        model_names=engine_args.served_model_name or (engine.model_name,),
        app_options=replace(options.app, on_startup=(on_startup,)),
        max_queue_len=max_queue_len,
        graceful_timeout_s=options.graceful_timeout_s,
        limits=limits,
        header_timeout_s=options.header_timeout_s,
        ssl_certfile=options.ssl_certfile,
        ssl_keyfile=options.ssl_keyfile,
        enable_prompt_tokens_details=options.enable_prompt_tokens_details,
        trust_request_chat_template=options.trust_request_chat_template,
        chat_parsing=options.chat_parsing,
    )


async def serve(engine_args: EngineArgs, options: ServerOptions,
                argv: list[str] | None = None) -> int:
    """Load the engine, serve until SIGTERM/SIGINT, drain, stop. Returns the exit code.

    argv: the `flowengine serve` flags, which API server processes 1..N-1 are started
    with (`--api-server-count` N > 1)."""
    # Listen before loading, as vLLM does: a port in use or a bad --host fails at once,
    # not after minutes of loading; connections wait in the backlog until serving.
    try:
        if options.uds is not None:
            sock = bind_unix_socket(options.uds, APIServer.BACKLOG)
            where = f"unix:{options.uds}"
        else:
            sock = bind_socket(options.host, options.port, APIServer.BACKLOG)
            host, port = sock.getsockname()[:2]
            where = host_port(host, port)
    except OSError as err:
        target = options.uds or host_port(options.host, options.port)
        logger.error("cannot listen on %s: %s", target, err)
        return 1
    sd_notify("STATUS=loading the model")
    t0 = time.monotonic()
    try:
        engine = create_engine(engine_args, options.api_server_count)
        started = getattr(engine, "start", lambda: None)()
        if inspect.isawaitable(started):
            await started
    except (ValueError, TypeError, OSError, ImportError, EngineDeadError,
            ModelDownloadError) as err:
        logger.error("cannot start the engine: %s", err)
        sock.close()
        if options.uds is not None:
            with contextlib.suppress(OSError):
                os.unlink(options.uds)
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
        names = engine_args.served_model_name or (engine.model_name,)
        scheme = "https" if options.ssl_certfile else "http"

        def ready() -> None:
            logger.info("serving %s on %s://%s", ", ".join(names), scheme, where)
            sd_notify(f"READY=1\nSTATUS=serving on {where}")

        max_queue_len = resolve_max_queue_len(engine, engine_args, options)
        server = build_api_server(engine, engine_args, options, max_queue_len, ready)
        grpc_server = None
        api_servers = None
        drain_began: list[float] = []
        try:
            if options.api_server_count > 1 and not engine_died:
                from flowengine.entrypoints.openai.api_servers import APIServerProcs

                # Processes 1..N-1 take connections from the same listening socket.
                procs = APIServerProcs(engine, sys.argv[1:] if argv is None else argv,
                                       sock, max_queue_len, options.api_server_count)
                try:
                    await procs.start()  # every process serves before this one does
                except RuntimeError as err:
                    logger.error("%s", err)
                    return 1
                api_servers = procs
            if options.grpc_port is not None and not engine_died:
                from flowengine.entrypoints.grpc.server import GrpcServer

                # Same engine, same queue and request limits (one admission for both
                # front doors), same API key.
                grpc_server = GrpcServer(engine, names, server.context.admission,
                                         host=options.host, port=options.grpc_port,
                                         limits=server.context.limits,
                                         api_key=options.app.api_key)
                try:
                    await grpc_server.start()
                except OSError as err:
                    logger.error("%s", err)
                    return 1

            def begin_shutdown() -> None:
                # The other front doors drain with this one: the other API server
                # processes (SIGTERM), gRPC refusing new calls.
                drain_began.append(time.monotonic())
                if api_servers is not None:
                    api_servers.terminate()
                if grpc_server is not None:
                    grpc_server.start_draining()

            server.on_begin_shutdown = begin_shutdown
            if not engine_died:
                await server.serve(sock, install_signal_handlers=True)
        finally:
            if api_servers is not None:
                # They drain their own requests (SIGTERM), as this process did.
                await api_servers.stop(
                    ENGINE_SHUTDOWN_TIMEOUT_S if engine_died else options.graceful_timeout_s
                    + APIServer.CUT_TIMEOUT_S + APIServer.CLOSE_TIMEOUT_S)
            if grpc_server is not None:
                await grpc_server.stop(grace_s=grpc_grace_s(
                    options.graceful_timeout_s, drain_began[0] if drain_began else None,
                    time.monotonic(), engine_died, server.stop_forced))
            if options.uds is not None:
                with contextlib.suppress(OSError):
                    os.unlink(options.uds)
    finally:
        await engine.shutdown(drain_timeout_s=ENGINE_SHUTDOWN_TIMEOUT_S)
    if engine_died:
        return 1
    logger.info("stopped")
    return 0


def grpc_grace_s(graceful_timeout_s: float, drain_began: float | None, now: float,
                 engine_died: bool, forced: bool = False) -> float:
    """Seconds the running gRPC calls may still take once the HTTP server has stopped:
    what is left of `--graceful-timeout` since the drain began (gRPC drains beside HTTP,
    from the same SIGTERM, so both get the same deadline); 0 after a second stop
    request (HTTP's requests were cancelled at once too); ENGINE_SHUTDOWN_TIMEOUT_S
    when the engine died or the server stopped without a drain."""
    if forced:
        return 0.0
    if engine_died or drain_began is None:
        return ENGINE_SHUTDOWN_TIMEOUT_S
    return max(0.0, graceful_timeout_s - (now - drain_began))


def check_startup_config(engine_args: EngineArgs) -> None:
    """What can be found wrong in the engine arguments before loading (seconds, not the
    minutes a model load takes): a local model path that does not exist or holds no
    model, a --chat-template that does not open or is not valid Jinja (vLLM also
    loads it before serving). Raises FileNotFoundError or ValueError saying what to
    change."""
    from flowengine.tokenize.chat import load_chat_template

    if engine_args.model is not None:
        from flowengine.model.resolve import check_local_model

        check_local_model(engine_args.model)
    load_chat_template(engine_args.chat_template)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `flowengine serve`; returns the process exit code (0, 1, or
    EXIT_CONFIG_ERROR; argparse exits with 2 itself for an unknown or malformed flag)."""
    ns = make_parser().parse_args(argv)
    logging.basicConfig(
        level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        options = options_from(ns)
        engine_args = engine_args_from(ns)
        check_startup_config(engine_args)
    except (ValueError, TypeError, ImportError, FileNotFoundError) as err:
        # ImportError: a missing extra
        logger.error("%s", err)
        return EXIT_CONFIG_ERROR
    if options.api_server_count > 1 and (engine_args.placement == "inproc"
                                         or engine_args.data_parallel_size > 1
                                         or os.environ.get(TEST_ENGINE_ENV)):
        logger.error("--api-server-count %d needs --placement multiproc (or auto), "
                     "--data-parallel-size 1 and no %s", options.api_server_count,
                     TEST_ENGINE_ENV)
        return EXIT_CONFIG_ERROR
    if not options.log_requests:
        logging.getLogger("flowengine.entrypoints.openai.requests").setLevel(logging.WARNING)
    # Until the event loop installs its handlers (after loading), Ctrl-C just ends the
    # process: there is nothing to drain yet, and no KeyboardInterrupt traceback.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        import uvloop
    except ImportError:  # uvloop has no Windows build
        return asyncio.run(serve(engine_args, options, argv))
    return uvloop.run(serve(engine_args, options, argv))
