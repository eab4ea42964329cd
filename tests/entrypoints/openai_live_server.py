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

    `base_url` is "http://127.0.0.1:PORT". With `manage_engine=True` the engine is
    started (`await engine.start()`) on the server's loop before serving and shut down
    after, as `flowengine serve` does (for the real `AsyncEngine`).
    """

    def __init__(
        self,
        engine: Any,
        *,
        app_options: AppOptions | None = None,
        model_names: tuple[str, ...] | None = None,
        manage_engine: bool = False,
        **server_kwargs: Any,
    ) -> None:
        self.engine = engine
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._sock = bind_socket("127.0.0.1", 0, APIServer.BACKLOG)
        self.port = self._sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._options = replace(app_options or AppOptions(), on_startup=(self._ready.set,))
        self._model_names = model_names
        self._manage_engine = manage_engine
        self._server_kwargs = server_kwargs
        self.server: APIServer | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="live-server", daemon=True)

    def _run(self) -> None:
        async def main() -> None:
            self.loop = asyncio.get_running_loop()
            if self._manage_engine:
                await self.engine.start()
            try:
                self.server = APIServer(
                    self.engine,
                    model_names=self._model_names or (self.engine.model_name,),
                    app_options=self._options,
                    **self._server_kwargs,
                )
                await self.server.serve(self._sock)
            finally:
                if self._manage_engine:
                    await self.engine.shutdown(drain_timeout_s=5.0)

        try:
            asyncio.run(main())
        except BaseException as err:  # surfaced by start()/stop()
            self._error = err
            self._ready.set()

    def start(self, timeout_s: float = 10.0) -> LiveServer:
        self._thread.start()
        if not self._ready.wait(timeout_s) or self._error is not None:
            raise RuntimeError(f"the test server did not start: {self._error!r}")
        return self

    def begin_shutdown(self) -> None:
        assert self.loop is not None and self.server is not None
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
