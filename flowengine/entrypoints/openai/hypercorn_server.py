"""`APIServer`: one engine served over HTTP by Hypercorn, with a graceful drain.

Hypercorn is started programmatically (`hypercorn.asyncio.serve`) on an
already-listening socket handed over as `fd://N`, so the caller knows the address
(also for port 0) before serving, and `READY=1` can be sent once the socket listens.
Hypercorn's own shutdown closes the listening sockets at once, so the drain happens
before it is triggered: while draining, the socket stays open and new requests get
503, which tells clients and load balancers to go elsewhere instead of failing to
connect.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import Callable, Sequence

from hypercorn.asyncio import serve as hypercorn_serve
from hypercorn.config import Config

from flowengine.engine.protocol import EngineClient
from flowengine.entrypoints.openai.app import AppOptions, OpenAIApp
from flowengine.entrypoints.openai.chat_parsing import ChatParsingOptions
from flowengine.entrypoints.openai.context import ServingContext
from flowengine.entrypoints.openai.generation import Admission
from flowengine.entrypoints.openai.notify import sd_notify
from flowengine.entrypoints.openai.sampling import RequestLimits
from flowengine.metrics import ServingMetrics

logger = logging.getLogger(__name__)


class APIServer:
    """Serves `engine` with the OpenAI routes until `begin_shutdown()` completes.

    Args:
        engine: any `EngineClient`; the server neither starts nor stops it.
        model_names: names accepted in `model` (the first is the default).
        app_options: API key, CORS, body limit, start-up hooks.
        max_queue_len: server-side admission limit (None: none).
        graceful_timeout_s: longest wait for in-flight requests once draining; what is
            still running then is cut (streams end with an error event and `[DONE]`).
        limits: per-request limits (n, log-probabilities, n x max_tokens).
        header_timeout_s: seconds a connection may take to send a request's headers,
            also the idle keep-alive time between requests (Hypercorn's
            `keep_alive_timeout`: its idle timer runs until a request's headers are
            complete, so it cuts slow-header clients too).
        ssl_certfile, ssl_keyfile: serve HTTPS with this certificate chain and key
            (PEM files).
    """

    BACKLOG = 2048  # pending connections; bursts of a few hundred clients connect at once
    # After the drain, Hypercorn waits this long for connections to close (idle
    # keep-alive ones close at once; it cancels what remains).
    CLOSE_TIMEOUT_S = 3.0
    # After the graceful timeout cut the requests still running, this long for them
    # to send their last event / error.
    CUT_TIMEOUT_S = 5.0

    def __init__(
        self,
        engine: EngineClient,
        *,
        model_names: Sequence[str],
        app_options: AppOptions,
        max_queue_len: int | None = None,
        graceful_timeout_s: float = 120.0,
        limits: RequestLimits | None = None,
        header_timeout_s: float = 5.0,
        ssl_certfile: str | None = None,
        ssl_keyfile: str | None = None,
        enable_prompt_tokens_details: bool = False,
        trust_request_chat_template: bool = False,
        chat_parsing: ChatParsingOptions | None = None,
    ) -> None:
        if not model_names:
            raise ValueError("model_names is empty; give at least one served model name")
        self.engine = engine
        self.graceful_timeout_s = graceful_timeout_s
        self.header_timeout_s = header_timeout_s
        self.ssl_certfile = ssl_certfile
        self.ssl_keyfile = ssl_keyfile
        self.metrics = ServingMetrics(engine.get_stats, model_names[0])
        self.context = ServingContext(
            engine=engine,
            model_names=tuple(model_names),
            admission=Admission(max_queue_len),
            metrics=self.metrics,
            limits=limits or RequestLimits(),
            enable_prompt_tokens_details=enable_prompt_tokens_details,
            trust_request_chat_template=trust_request_chat_template,
            chat_parsing=chat_parsing or ChatParsingOptions(),
        )
        self.app = OpenAIApp(self.context, app_options)
        self._stop: asyncio.Event | None = None
        self._drain_task: asyncio.Task[None] | None = None
        # A second stop request ended the drain at once (the other front doors follow).
        self.stop_forced = False
        # Called when the drain begins (the other API server processes drain too).
        self.on_begin_shutdown: Callable[[], None] | None = None

    async def serve(self, sock: socket.socket, *, install_signal_handlers: bool = False) -> None:
        """Serve on a bound, listening socket (taken over: do not use it afterwards).

        Returns after `begin_shutdown()` (or SIGTERM/SIGINT with
        `install_signal_handlers`) has drained and Hypercorn has closed.
        """
        self._stop = asyncio.Event()
        config = Config()
        config.bind = [f"fd://{sock.detach()}"]
        config.backlog = self.BACKLOG
        config.graceful_timeout = self.CLOSE_TIMEOUT_S
        config.keep_alive_timeout = self.header_timeout_s
        config.root_path = self.app.options.root_path
        if self.ssl_certfile is not None:
            config.certfile = self.ssl_certfile
            config.keyfile = self.ssl_keyfile
        config.errorlog = logging.getLogger("hypercorn.error")
        # Access lines hold paths and statuses only (no bodies); written at --log-level debug.
        if logger.isEnabledFor(logging.DEBUG):
            config.accesslog = logging.getLogger("hypercorn.access")
        loop = asyncio.get_running_loop()
        signals = (signal.SIGTERM, signal.SIGINT) if install_signal_handlers else ()
        for sig in signals:
            loop.add_signal_handler(sig, self.begin_shutdown)
        try:
            await hypercorn_serve(self.app, config, shutdown_trigger=self._stop.wait)
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)
            if self._drain_task is not None:
                self._drain_task.cancel()

    def begin_shutdown(self) -> None:
        """Start the drain (call on the server's loop); a second call ends the requests in
        flight at once, as the graceful timeout's end does, then stops."""
        if self._stop is None:
            raise RuntimeError("begin_shutdown() before serve(); nothing to stop")
        if self._drain_task is not None:
            if self.stop_forced:  # a third: stop without waiting for the cut
                self._stop.set()
                return
            logger.warning("second stop request: ending in-flight requests now")
            self.stop_forced = True
            # Cut as the graceful timeout does (a stream's error event and [DONE], a
            # 503): stopping Hypercorn at once cancelled them mid-body (a 500, a stream
            # without its end, CancelledError tracebacks in the log).
            self._drain_task.cancel()
            self._drain_task = asyncio.get_running_loop().create_task(self._cut())
            return
        self.app.start_draining()
        if self.on_begin_shutdown is not None:
            self.on_begin_shutdown()
        sd_notify("STOPPING=1\nSTATUS=draining in-flight requests")
        logger.info(
            "draining: %d requests in flight, waiting up to %.0f s",
            self.app.num_in_flight,
            self.graceful_timeout_s,
        )
        self._drain_task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        assert self._stop is not None
        if not await self.app.wait_idle(self.graceful_timeout_s):
            num_cut = self.app.cut_in_flight()
            logger.warning(
                "graceful timeout (%.0f s): ending %d requests still in flight with an error",
                self.graceful_timeout_s,
                num_cut,
            )
            await self.app.wait_idle(self.CUT_TIMEOUT_S)
        self._stop.set()

    async def _cut(self) -> None:
        """The second stop request's end: what is in flight is cut at once."""
        assert self._stop is not None
        self.app.cut_in_flight()
        await self.app.wait_idle(self.CUT_TIMEOUT_S)
        self._stop.set()
