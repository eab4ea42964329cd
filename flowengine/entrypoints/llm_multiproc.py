"""`LLM` over the multiproc `AsyncEngine`: an event loop in a background thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any

from flowengine.outputs import CompletionOutput, RequestOutput


def merge_delta(total: RequestOutput | None, delta: RequestOutput) -> RequestOutput:
    """Fold one streamed delta into the cumulative output of its request."""
    if total is None:
        total = RequestOutput(delta.request_id, delta.prompt, delta.prompt_token_ids)
    by_index = {c.index: c for c in total.outputs}
    for c in delta.outputs:
        acc = by_index.get(c.index)
        if acc is None:
            acc = by_index[c.index] = CompletionOutput(
                c.index, "", [], logprobs=[] if c.logprobs is not None else None
            )
        acc.text += c.text
        acc.token_ids.extend(c.token_ids)
        if c.logprobs is not None and acc.logprobs is not None:
            acc.logprobs.extend(c.logprobs)
        acc.cumulative_logprob = c.cumulative_logprob
        acc.finish_reason, acc.stop_reason = c.finish_reason, c.stop_reason
    total.outputs = [by_index[i] for i in sorted(by_index)]
    total.finished = delta.finished
    total.num_cached_tokens = delta.num_cached_tokens or total.num_cached_tokens
    total.error = delta.error or total.error
    if delta.prompt_logprobs is not None:
        total.prompt_logprobs = delta.prompt_logprobs
    return total


class BackgroundEngine:
    """Runs an `AsyncEngine` on its own event loop thread for synchronous callers."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                        name="flowengine-llm")
        self._thread.start()
        self.call(engine.start())

    def call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    async def _one(self, prompt: Any, params: Any, request_id: str, on_done) -> RequestOutput:
        total = None
        async for delta in self.engine.submit(prompt, params, request_id):
            total = merge_delta(total, delta)
        on_done()
        return total

    def generate(self, jobs: list[tuple[Any, Any, str]], on_done) -> list[RequestOutput]:
        """Run (prompt, params, request_id) jobs concurrently; results in job order."""

        async def run_all():
            return await asyncio.gather(*(self._one(p, sp, rid, on_done) for p, sp, rid in jobs))

        return self.call(run_all())

    def embed(self, jobs: list[tuple[Any, Any, str]], on_done) -> list[Any]:
        """Run (prompt, PoolingParams, request_id) embedding jobs concurrently; the
        EmbeddingRequestOutputs in job order."""

        async def one(prompt: Any, params: Any, request_id: str) -> Any:
            out = None
            async for delta in self.engine.encode(prompt, params, request_id):
                out = delta
            on_done()
            return out

        async def run_all():
            return await asyncio.gather(*(one(p, pp, rid) for p, pp, rid in jobs))

        return self.call(run_all())

    def close(self) -> None:
        if self.loop.is_running():
            self.call(self.engine.shutdown(drain_timeout_s=5.0))
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
