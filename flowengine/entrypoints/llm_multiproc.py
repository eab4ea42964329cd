"""`LLM` over the multiproc `AsyncEngine`: an event loop in a background thread."""

from __future__ import annotations

import asyncio
import atexit
import threading
from collections.abc import Coroutine
from typing import Any

from flowengine.outputs import RequestOutput
from flowengine.sampling_params import RequestOutputKind


class BackgroundEngine:
    """Runs an `AsyncEngine` on its own event loop thread for synchronous callers."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                        name="flowengine-llm")
        self._thread.start()
        # NOTE: close() needs the loop thread, and the interpreter freezes daemon threads
        # before it collects objects at exit: an LLM still alive then (a script that
        # ends, or ends in Ctrl-C, without llm.shutdown()) hung forever in __del__.
        # atexit runs while the thread still runs.
        atexit.register(self.close)
        self.call(engine.start())

    def call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        except BaseException:
            # E.g. KeyboardInterrupt: cancelling closes the streams, which aborts the
            # requests still running (as the in-process LLM does).
            future.cancel()
            raise

    async def _gather(self, coros: list[Coroutine[Any, Any, Any]]) -> list[Any]:
        """Await the coroutines concurrently, at most the engine's max_queue_len at a
        time: it refuses more in flight (EngineOverloadedError), while an offline batch
        takes any number of prompts (as vLLM's LLM). Results in order."""
        slots = asyncio.Semaphore(self.engine.max_queue_len)

        async def one(coro: Coroutine[Any, Any, Any]) -> Any:
            try:
                async with slots:
                    return await coro
            finally:
                coro.close()  # cancelled before it started: dropped without a warning

        return await asyncio.gather(*(one(c) for c in coros))

    async def _one(self, prompt: Any, params: Any, request_id: str, priority: int,
                   on_done) -> RequestOutput:
        # FINAL_ONLY: the output processor folds; the one output is the whole result.
        final = None
        async for out in self.engine.submit(prompt, params, request_id, priority=priority,
                                            output_kind=RequestOutputKind.FINAL_ONLY):
            final = out
        on_done()
        return final

    def generate(self, jobs: list[tuple[Any, Any, str, int]], on_done) -> list[RequestOutput]:
        """Run (prompt, params, request_id, priority) jobs concurrently; results in job
        order."""
        return self.call(self._gather([self._one(p, sp, rid, prio, on_done)
                                       for p, sp, rid, prio in jobs]))

    def embed(self, jobs: list[tuple[Any, Any, str]], on_done) -> list[Any]:
        """Run (prompt, PoolingParams, request_id) embedding jobs concurrently; the
        EmbeddingRequestOutputs in job order."""

        async def one(prompt: Any, params: Any, request_id: str) -> Any:
            out = None
            async for delta in self.engine.encode(prompt, params, request_id):
                out = delta
            on_done()
            return out

        return self.call(self._gather([one(p, pp, rid) for p, pp, rid in jobs]))

    def close(self) -> None:
        """Stop the engine (its processes) and the loop thread; later calls are no-ops.
        Runs at interpreter exit too (atexit) when nobody called it."""
        atexit.unregister(self.close)
        if self.loop.is_running() and self._thread.is_alive():
            self.call(self.engine.shutdown(drain_timeout_s=5.0))
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
