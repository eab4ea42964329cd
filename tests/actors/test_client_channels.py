"""The engine process's channels to several API server processes (actors/clients.py),
over in-process channels: one inbox over every client's requests, each client's own
share of the outputs, refusals sent to the sender only, and no record lost while the
inbox waits on every ring at once."""

from __future__ import annotations

import asyncio

from flowengine.actors.clients import ClientOutputs, ClientRequests
from flowengine.engine.client_router import ClientRouter
from flowengine.messages import (
    AbortRequest,
    ClientStart,
    EngineOutputs,
    NewRequest,
    RequestDelta,
    SchedulerStats,
)
from flowengine.sampling_params import SamplingParams
from flowengine.shm.inproc import InprocChannel


def _new(rid: str) -> NewRequest:
    return NewRequest(rid, [1, 2], SamplingParams(max_tokens=2), 0.0)


def _channels(n: int, live: set[str]):
    router = ClientRouter(n, live.__contains__)
    requests = [InprocChannel() for _ in range(n)]
    outputs = [InprocChannel() for _ in range(n)]
    out = ClientOutputs(outputs, router, generation=3)
    return ClientRequests(requests, router, out), out, requests, outputs


def _drain(channel: InprocChannel) -> list:
    got = []
    while (msg := channel.try_recv()) is not None:
        got.append(msg)
    return got


def test_one_inbox_over_every_client_and_outputs_split_by_owner():
    async def main():
        live: set[str] = set()
        inbox, outbox, requests, outputs = _channels(3, live)
        for client, rid in ((0, "a"), (2, "c"), (1, "b"), (2, "d")):
            await requests[client].send_async(_new(rid))
        got = [inbox.try_recv() for _ in range(4)]
        assert sorted(m.request_id for m in got) == ["a", "b", "c", "d"]
        assert inbox.try_recv() is None
        live.update("abcd")
        stats = SchedulerStats(num_running=4)
        await outbox.send_async(EngineOutputs(
            [RequestDelta("a", [5]), RequestDelta("c", [6]), RequestDelta("d", [7], "stop")],
            1.5, stats, 3))
        per_client = [_drain(ch) for ch in outputs]
        # Every client gets the step (its stats), with its own deltas only.
        assert [[d.req_id for m in msgs for d in m.outputs] for msgs in per_client] == [
            ["a"], [], ["c", "d"]]
        assert all(m.stats == stats and m.generation == 3 and m.timestamp == 1.5
                   for msgs in per_client for m in msgs)
        # A stats-only message (the ready message) goes to all as it is.
        ready = EngineOutputs([], 2.0, stats, 3)
        await outbox.send_async(ready)
        assert [_drain(ch) for ch in outputs] == [[ready], [ready], [ready]]

    asyncio.run(main())


def test_refusal_reaches_the_sender_and_aborts_stay_with_their_owner():
    async def main():
        live = {"x", "y"}
        inbox, outbox, requests, outputs = _channels(2, live)
        await requests[0].send_async(_new("x"))
        await requests[1].send_async(_new("y"))
        assert {inbox.try_recv().request_id, inbox.try_recv().request_id} == {"x", "y"}
        await requests[1].send_async(_new("x"))  # client 0's live id
        await requests[1].send_async(AbortRequest(["x", "y"]))
        msg = inbox.try_recv()
        assert msg == AbortRequest(["y"])  # the refused NewRequest never reaches the core
        refusal = _drain(outputs[1])
        assert len(refusal) == 1 and refusal[0].generation == 3
        [delta] = refusal[0].outputs
        assert delta.req_id == "x" and delta.finish_reason == "error"
        assert _drain(outputs[0]) == []
        await requests[0].send_async(ClientStart())
        assert inbox.try_recv() == AbortRequest(["x"])

    asyncio.run(main())


def test_waiting_on_every_ring_loses_no_record():
    async def main():
        inbox, _, requests, _ = _channels(3, set())
        # Records arrive on two rings while the inbox waits on all three: both are
        # delivered, in turn, whichever waiter woke first.
        waiter = asyncio.ensure_future(inbox.recv_async())
        await asyncio.sleep(0.01)
        requests[2].try_send(_new("r2"))
        requests[1].try_send(_new("r1"))
        first = await asyncio.wait_for(waiter, 5)
        second = await asyncio.wait_for(inbox.recv_async(), 5)
        assert {first.request_id, second.request_id} == {"r1", "r2"}
        # A cancelled wait consumes nothing.
        waiter = asyncio.ensure_future(inbox.recv_async())
        await asyncio.sleep(0.01)
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        requests[0].try_send(_new("r0"))
        assert (await asyncio.wait_for(inbox.recv_async(), 5)).request_id == "r0"

    asyncio.run(main())
