"""A live `APIServer` on 127.0.0.1 (a free port) in a background thread, for tests."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace
from typing import Any

from flowengine.entrypoints.openai.app import AppOptions
from flowengine.entrypoints.openai.hypercorn_server import APIServer
from flowengine.entrypoints.openai.server import bind_socket


class LiveServer:
    """Runs `APIServer(engine, ...)` on its own event loop thread.

    `base_url` is "http://127.0.0.1:PORT"; `call(fn)` runs `fn()` on the server's loop
    and returns its result (for code that must touch loop-bound state).
    """

    def __init__(
        self,
        engine: Any,
        *,
        app_options: AppOptions | None = None,
        model_names: tuple[str, ...] | None = None,
        **server_kwargs: Any,
    ) -> None:
        self.engine = engine
        self._ready = threading.Event()
        self._error: BaseException | None = None
        sock = bind_socket("127.0.0.1", 0, APIServer.BACKLOG)
        self.port = sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        options = replace(app_options or AppOptions(), on_startup=(self._ready.set,))
        self.server = APIServer(
            engine,
            model_names=model_names or (engine.model_name,),
            app_options=options,
            **server_kwargs,
        )
        self._sock = sock
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="live-server", daemon=True)

    def _run(self) -> None:
        async def main() -> None:
            self.loop = asyncio.get_running_loop()
            await self.server.serve(self._sock)

        try:
            asyncio.run(main())
        except BaseException as err:  # surfaced by start()/stop()
            self._error = err
            self._ready.set()

    def start(self) -> LiveServer:
        self._thread.start()
        if not self._ready.wait(10) or self._error is not None:
            raise RuntimeError(f"the test server did not start: {self._error!r}")
        return self

    def begin_shutdown(self) -> None:
        assert self.loop is not None
        self.loop.call_soon_threadsafe(self.server.begin_shutdown)

    def stop(self, timeout_s: float = 15.0) -> None:
        if self._thread.is_alive():
            self.begin_shutdown()
            self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise RuntimeError("the test server did not stop")
        if self._error is not None:
            raise self._error

    def __enter__(self) -> LiveServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
