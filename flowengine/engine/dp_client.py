"""Data-parallel replicas behind one `AsyncEngine` (issue #18; docs/design.md).

`--data-parallel-size N` starts N engine groups, each under its own `Supervisor` with
its own four rings, engine process (scheduler + KV cache) and executor process(es).
The frontend's actors (tokenizer, detokenizer, streamer) are shared; between them and
the replicas sit:

- `DPRequests`: the frontend's "requests" channel. A `NewRequest` goes to the replica
  `DPRouter.route` picks (not one that is restarting, its gate closed, while another
  can take it); an `AbortRequest` is split by owner; `Shutdown` goes to all.
- `ReplicaOutputs` (one actor per replica): reads the replica's "outputs" ring, drops
  outputs of replaced engine generations (the replica's own restart count), updates
  the router's load and finished requests, and forwards the rest into the one inbox
  the Detokenizer reads (`MergedOutputs`; re-stamped generation 0: the Detokenizer's
  own generation check then passes, the per-replica one has been done here).
- `ReplicaWatcher` (one per replica): runs the replica's `Supervisor` (restarts with
  recompute, as without DP). When the supervisor gives up (its restarts failed in a
  row), the replica is down for good: its requests are resubmitted, with the tokens
  already delivered, to live replicas. Only when no replica is left does the engine
  die (EngineDeadError).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel
import msgspec

from flowengine.engine.dp_router import DPRouter
from flowengine.engine.protocol import EngineDeadError
from flowengine.messages import AbortRequest, EngineOutputs, NewRequest, SchedulerStats, Shutdown
from flowengine.shm.inproc import InprocChannel

logger = logging.getLogger(__name__)


class _Discard:
    """Where sends to a replica that is down for good go (its ring has no reader)."""

    async def send_async(self, msg: Any) -> None:
        return None

    def close(self) -> None:
        return None


class DPRequests:
    """The frontend's requests channel over N replicas' `RequestsGate`s.

    Same sending interface as `Channel` (`send_async`, `close`).
    Raises NoLiveReplicaError (from the router) when every replica is down.
    """

    def __init__(self, router: DPRouter, gates: list[Any]) -> None:
        self.router = router
        self.gates = gates

    async def send_async(self, msg: Any) -> None:
        if isinstance(msg, NewRequest):
            for i, gate in enumerate(self.gates):  # a closed gate: that replica restarts
                self.router.set_paused(i, not gate.is_open)
            replica = self.router.route(msg.request_id, msg.prompt_token_ids, msg.cache_salt)
            await self.gates[replica].send_async(msg)
        elif isinstance(msg, AbortRequest):
            by_replica: dict[int, list[str]] = {}
            for rid in msg.request_ids:
                replica = self.router.finish(rid)
                if replica is not None:
                    by_replica.setdefault(replica, []).append(rid)
            for replica, ids in by_replica.items():
                await self.gates[replica].send_async(AbortRequest(ids))
        elif isinstance(msg, Shutdown):
            for replica, gate in enumerate(self.gates):
                if self.router.replicas[replica].is_alive:
                    await gate.send_async(msg)
        else:
            raise TypeError(f"unexpected request message {type(msg).__name__}")

    def close(self) -> None:
        for gate in self.gates:
            gate.close()


class MergedOutputs:
    """The Detokenizer's inbox of every replica's outputs (`Channel`'s receiving side).

    A replica's ready message after a restart carries its Supervisor's event, set when
    the Detokenizer takes that message: by then it has processed every earlier output of
    that replica, so the resubmission that follows the event sees every token already
    delivered (NOTE: setting it on arrival instead could resubmit a request without
    tokens still queued here, and the caller would get them twice).
    """

    def __init__(self) -> None:
        self._queue: InprocChannel = InprocChannel()

    async def send_async(self, msg: EngineOutputs, ready: anyio.Event | None = None) -> None:
        await self._queue.send_async((msg, ready))

    def _take(self, item: tuple[EngineOutputs, anyio.Event | None]) -> EngineOutputs:
        msg, ready = item
        if ready is not None:
            ready.set()
        return msg

    async def recv_async(self) -> EngineOutputs:
        return self._take(await self._queue.recv_async())

    def try_recv(self) -> EngineOutputs | None:
        item = self._queue.try_recv()
        return None if item is None else self._take(item)

    def close(self) -> None:
        self._queue.close()


class ReplicaOutputs:
    """Forwards one replica's current-generation outputs into the Detokenizer's inbox."""

    def __init__(self, index: int, outputs: Any, router: DPRouter, inbox: MergedOutputs) -> None:
        self.index = index
        self.outputs = outputs
        self.router = router
        self.inbox = inbox
        self.generation = 0
        self.stats = SchedulerStats()
        self.generation_tokens_total = 0
        self._ready: anyio.Event | None = None
        self._scope = anyio.CancelScope()

    def stop(self) -> None:
        """Stop reading (the replica is lost; its ring is about to be freed)."""
        self._scope.cancel()

    def expect_generation(self, generation: int) -> anyio.Event:
        """The Supervisor's hook: drop outputs of older generations from now on; the
        event is set when `generation`'s ready message arrives."""
        self.generation = generation
        self._ready = anyio.Event()
        return self._ready

    async def run(self) -> None:
        with self._scope:
            await self._forward()
        await anyio.sleep_forever()  # lost: stay (a finished actor ends the task group)

    async def _forward(self) -> None:
        while True:
            msg: EngineOutputs = await self.outputs.recv_async()
            if msg.generation != self.generation:
                continue  # a replaced engine's; its requests are recomputed
            ready, self._ready = self._ready, None
            if msg.stats is not None:
                self.stats = msg.stats
                self.router.update_stats(self.index, msg.stats)
            for delta in msg.outputs:
                self.generation_tokens_total += len(delta.new_token_ids)
                if delta.finish_reason is not None:
                    self.router.finish(delta.req_id)
            await self.inbox.send_async(msgspec.structs.replace(msg, generation=0), ready)


class ReplicaWatcher:
    """Runs one replica's Supervisor; moves its requests elsewhere if it is lost.

    Args:
        index: the replica (engine index).
        supervisor: its started `Supervisor`.
        outputs: its `ReplicaOutputs` actor.
        router, requests: the shared router and `DPRequests`.
        live_requests: returns the `NewRequest`s that recompute every unfinished
            request from what was delivered (the Detokenizer's resubmission list).
    """

    def __init__(self, index: int, supervisor: Any, outputs: ReplicaOutputs, router: DPRouter,
                 requests: DPRequests, live_requests: Callable[[], list[NewRequest]]) -> None:
        self.index = index
        self.supervisor = supervisor
        self.outputs = outputs
        self.router = router
        self.requests = requests
        self.live_requests = live_requests
        self.is_lost = False

    async def run(self) -> None:
        try:
            await self.supervisor.run()
            return
        except EngineDeadError as exc:
            error = exc
        await self._fail_over(error)

    async def _fail_over(self, error: EngineDeadError) -> None:
        held = self.router.mark_dead(self.index)
        self.is_lost = True
        gate = self.requests.gates[self.index]
        ring = gate.channel
        # A send that waited at this replica's gate writes to no ring now.
        gate.channel = _Discard()
        self.outputs.stop()
        await anyio.lowlevel.checkpoint()  # let the reader leave its recv first
        with anyio.CancelScope(shield=True):
            await self.supervisor.stop(timeout_s=0.0)
        ring.close()
        if self.router.num_alive == 0:
            raise EngineDeadError(f"every data-parallel replica is down; the last: {error}")
        moved = [m for m in self.live_requests() if m.request_id in held]
        logger.error("data-parallel replica %d is down for good (%s); resubmitting its %d "
                     "request(s) to the %d live replica(s)", self.index, error, len(moved),
                     self.router.num_alive)
        for msg in moved:
            await self.requests.send_async(msg)
        # Keep running (as a finished actor would end the task group).
        await anyio.sleep_forever()
