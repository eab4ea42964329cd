"""Streamer: routes each `RequestOutput` to its caller's stream (DESIGN.md §1).

Not a task of its own: the Detokenizer calls `route` with each step's outputs, so an
output goes from the output processor into its caller's stream with no queue between
(and the caller's task is woken once per step at most).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from flowengine.outputs import RequestOutput


class RequestStream:
    """One caller's outputs. Outputs the caller has not taken yet are folded into one
    (`RequestOutput.add`: DELTA outputs concatenated, `aggregate`; CUMULATIVE ones
    replaced by the newest), so a slow caller wakes once for all of them, and a fast one
    once per step at most. An exception is raised to the caller after the pending output.
    """

    __slots__ = ("request_id", "aggregate", "finished", "_pending", "_error", "_waiter")

    def __init__(self, request_id: str, aggregate: bool = True) -> None:
        self.request_id = request_id
        self.aggregate = aggregate
        self.finished = False
        self._pending: RequestOutput | None = None
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            if self._error is None:
                self._error = item
        elif self._pending is None:
            self._pending = item
        else:
            self._pending.add(item, self.aggregate)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def take(self) -> RequestOutput | None:
        """The output the caller has not taken yet (folded outputs), or None if there is
        none now: then await `wait()` and take again.

        Raises the stream's exception once no output is pending (the stream is over).
        """
        item = self._pending
        if item is None:
            if self._error is None:
                return None
            self.finished = True
            raise self._error
        self._pending = None
        if item.finished:
            self.finished = True
        return item

    def wait(self) -> asyncio.Future[None]:
        """A future that the next `put` resolves. Cancelling the task that awaits it is
        safe: put() skips a cancelled future and nothing is lost (it stays pending)."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiter = waiter
        return waiter

    async def get(self) -> RequestOutput:
        """Await the next output (`take`, waiting while there is none)."""
        # NOTE: AsyncEngine.submit inlines this loop: one coroutine frame less per
        # output on the path every caller takes once per step.
        while (item := self.take()) is None:
            await self.wait()
        return item


class StreamerActor:
    """Owns the per-request streams; `route` hands each output to its caller.

    Args:
        on_orphan: called with a request id whose caller is gone (the stream was
            dropped), so the request can be aborted.
    """

    def __init__(self, on_orphan: Callable[[str], None] | None = None) -> None:
        self._streams: dict[str, RequestStream] = {}
        self._on_orphan = on_orphan
        self.busy_s = 0.0  # time spent routing (for `flowengine bench pipeline`)

    def open(self, request_id: str, aggregate: bool = True) -> RequestStream:
        """A new stream; aggregate: its outputs are DELTAs (see `RequestStream`)."""
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = self._streams[request_id] = RequestStream(request_id, aggregate)
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

    def route(self, outputs: list[RequestOutput]) -> None:
        """Put each output into its caller's stream (the one object the output
        processor made, not re-wrapped); a finished one closes the stream. An output
        whose stream is gone (the caller left) and that is not finished is reported to
        `on_orphan`, so the engine stops the request."""
        start = time.perf_counter()
        streams = self._streams
        for out in outputs:
            stream = streams.get(out.request_id)
            if stream is None:
                if not out.finished and self._on_orphan is not None:
                    self._on_orphan(out.request_id)
                continue
            stream.put(out)
            if out.finished:
                del streams[out.request_id]
        self.busy_s += time.perf_counter() - start
