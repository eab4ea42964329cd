"""The engine process's channels to several API server processes (`--api-server-count`).

`ClientRequests` reads every client's requests ring as one inbox and `ClientOutputs`
writes each client its own share of a step's outputs; both use one `ClientRouter`
(flowengine/engine/client_router.py: who owns which request). The Scheduler actor sees
one requests channel and one outputs channel, as with a single frontend.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any

from flowengine.actors.base import Channel
from flowengine.engine.client_router import ClientRouter
from flowengine.messages import EngineOutputs, RequestDelta


class ClientOutputs:
    """Outbox of `EngineOutputs`: each step's deltas split by owning client; every
    client gets every message, with its own deltas only (empty: the stats alone, which
    its /metrics gauges and logs show), so none is left with stale stats.

    Args:
        channels: one outputs channel per client, client 0 first.
        router: the ownership map shared with `ClientRequests`.
        generation: the engine generation stamped on refusals sent directly.
    """

    def __init__(self, channels: list[Channel], router: ClientRouter, generation: int = 0) -> None:
        if len(channels) != router.num_clients:
            raise ValueError(f"{len(channels)} output channels for {router.num_clients} clients")
        self.channels = channels
        self.router = router
        self.generation = generation
        self._direct: deque[tuple[int, EngineOutputs]] = deque()

    def send_direct(self, client: int, delta: RequestDelta) -> None:
        """Send `delta` to `client` now (a refusal from `ClientRequests.try_recv`, which
        cannot await); if its ring is full, with the next step's outputs."""
        msg = EngineOutputs([delta], time.time(), None, self.generation)
        if self._direct or not self.channels[client].try_send(msg):
            self._direct.append((client, msg))

    async def send_async(self, msg: EngineOutputs) -> None:
        while self._direct:
            client, direct = self._direct[0]
            await self.channels[client].send_async(direct)
            self._direct.popleft()
        if not msg.outputs:  # the ready message, or stats only
            for channel in self.channels:
                await channel.send_async(msg)
            return
        for i, part in enumerate(self.router.split(msg.outputs)):
            await self.channels[i].send_async(
                EngineOutputs(part, msg.timestamp, msg.stats, msg.generation))

    def close(self) -> None:
        for channel in self.channels:
            channel.close()


class ClientRequests:
    """Inbox of requests from every client's ring, through the router (fair: the ring
    read first rotates). Refusals go straight to the sender through `outputs`."""

    def __init__(self, channels: list[Channel], router: ClientRouter,
                 outputs: ClientOutputs) -> None:
        if len(channels) != router.num_clients:
            raise ValueError(f"{len(channels)} request channels for {router.num_clients} clients")
        self.channels = channels
        self.router = router
        self.outputs = outputs
        self._next = 0
        # Records read while waiting on every ring at once, not handed out yet.
        self._ready: deque[tuple[int, Any]] = deque()

    def _admit(self, client: int, msg: Any) -> Any | None:
        passed, refusal = self.router.admit(client, msg)
        if refusal is not None:
            self.outputs.send_direct(client, refusal)
        return passed

    def try_recv(self) -> Any | None:
        while self._ready:
            passed = self._admit(*self._ready.popleft())
            if passed is not None:
                return passed
        n = len(self.channels)
        start = self._next
        self._next = (start + 1) % n
        for k in range(n):
            client = (start + k) % n
            while (msg := self.channels[client].try_recv()) is not None:
                passed = self._admit(client, msg)
                if passed is not None:
                    return passed
        return None

    async def recv_async(self) -> Any:
        while True:
            msg = self.try_recv()
            if msg is not None:
                return msg
            # Wait on every ring; a record read by a waiter that lost the race is kept
            # (a cancelled recv_async loses nothing: the read happens after the wait).
            waiters = {asyncio.ensure_future(ch.recv_async()): i
                       for i, ch in enumerate(self.channels)}
            try:
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in waiters:
                    task.cancel()
                await asyncio.wait(waiters)  # each task ends: with a record or cancelled
            error: BaseException | None = None
            for task, client in waiters.items():
                if task.cancelled():
                    continue
                if task.exception() is not None:
                    error = error or task.exception()  # a ring closed: the caller's error
                else:
                    self._ready.append((client, task.result()))
            if error is not None:
                raise error

    def close(self) -> None:
        for channel in self.channels:
            channel.close()
