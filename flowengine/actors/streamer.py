"""Streamer actor: routes each `RequestOutput` delta to its caller's stream (DESIGN.md §1)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from flowengine.outputs import RequestOutput
from flowengine.shm.inproc import InprocChannel


class RequestStream:
    """One caller's queue of outputs; `None` closes it, an exception is raised to it."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    def put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    async def get(self) -> RequestOutput:
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item


class StreamerActor:
    """Owns the per-request streams.

    Args:
        on_orphan: called with a request id whose caller is gone (the stream was
            dropped), so the request can be aborted.
    """

    def __init__(self, on_orphan: Callable[[str], None] | None = None) -> None:
        self.inbox = InprocChannel()
        self._streams: dict[str, RequestStream] = {}
        self._on_orphan = on_orphan
        self.busy_s = 0.0  # time spent routing (for `flowengine bench pipeline`)

    def open(self, request_id: str) -> RequestStream:
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = self._streams[request_id] = RequestStream(request_id)
        return stream

    def close(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def fail_all(self, exc: BaseException) -> None:
        """Deliver `exc` to every open stream (the engine died)."""
        for stream in self._streams.values():
            stream.put(exc)
        self._streams.clear()

    def __len__(self) -> int:
        return len(self._streams)

    async def run(self) -> None:
        while True:
            outputs: list[RequestOutput] = await self.inbox.recv_async()
            start = time.perf_counter()
            self._route(outputs)
            self.busy_s += time.perf_counter() - start

    def _route(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                if not out.finished and self._on_orphan is not None:
                    self._on_orphan(out.request_id)
                continue
            stream.put(out)
            if out.finished:
                del self._streams[out.request_id]
