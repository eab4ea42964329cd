"""Data-parallel plumbing without processes: requests and aborts reach the replica
that holds them, outputs of a replaced generation are dropped, a restarted replica's
ready event waits for the Detokenizer, and a replica that is down for good hands its
requests (with the tokens delivered) to a live one while the engine keeps serving."""

from __future__ import annotations

import anyio
import pytest

from flowengine.engine.dp_client import DPRequests, MergedOutputs, ReplicaOutputs, ReplicaWatcher
from flowengine.engine.dp_router import DPRouter
from flowengine.engine.protocol import EngineDeadError
from flowengine.messages import (
    AbortRequest,
    EngineOutputs,
    NewRequest,
    RequestDelta,
    SchedulerStats,
    Shutdown,
)
from flowengine.sampling_params import SamplingParams
from flowengine.shm.inproc import InprocChannel


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the engine's loop (InprocChannel waits on asyncio futures)


class FakeGate:
    def __init__(self) -> None:
        self.channel = InprocChannel()
        self.closed = False
        self.is_open = True

    async def send_async(self, msg) -> None:
        await self.channel.send_async(msg)

    def close(self) -> None:
        self.closed = True

    def drain(self) -> list:
        out = []
        while (m := self.channel.try_recv()) is not None:
            out.append(m)
        return out


class DeadSupervisor:
    """A supervisor whose restarts all failed."""

    def __init__(self) -> None:
        self.stopped = False

    async def run(self) -> None:
        raise EngineDeadError("the engine group failed 20 restarts in a row; giving up")

    async def stop(self, timeout_s: float = 10.0) -> None:
        self.stopped = True


def _req(rid: str, tokens: list[int], out: list[int] | None = None) -> NewRequest:
    return NewRequest(rid, tokens, SamplingParams(max_tokens=4), 0.0,
                      output_token_ids=out or [])


@pytest.mark.anyio
async def test_routing_aborts_and_shutdown_reach_the_right_replicas() -> None:
    router = DPRouter(2, block_size=4, max_prefix_blocks=0)
    gates = [FakeGate(), FakeGate()]
    requests = DPRequests(router, gates)
    for i in range(4):
        await requests.send_async(_req(f"r{i}", [i] * 8))
    assert [[m.request_id for m in g.drain()] for g in gates] == [["r0", "r2"], ["r1", "r3"]]
    await requests.send_async(AbortRequest(["r3", "r0", "gone"]))
    assert [[m.request_ids for m in g.drain()] for g in gates] == [[["r0"]], [["r3"]]]
    assert router.owner("r0") is None and router.owner("r2") == 0
    # Replica 0 restarting (gate closed): new work goes to 1 although 0 is less loaded.
    gates[0].is_open = False
    await requests.send_async(_req("r4", [4] * 8))
    await requests.send_async(_req("r5", [5] * 8))
    assert [len(g.drain()) for g in gates] == [0, 2]
    gates[0].is_open = True
    await requests.send_async(Shutdown())
    assert [[type(m) for m in g.drain()] for g in gates] == [[Shutdown], [Shutdown]]
    with pytest.raises(TypeError, match="unexpected request message"):
        await requests.send_async("hello")


@pytest.mark.anyio
async def test_replica_outputs_drop_old_generations_and_wait_for_the_detokenizer() -> None:
    router = DPRouter(2, block_size=4, max_prefix_blocks=0)
    router.route("a", [1])
    router.route("b", [2])  # replica 1
    ring = InprocChannel()
    merged = MergedOutputs()
    replica = ReplicaOutputs(1, ring, router, merged)
    stats = SchedulerStats(num_running=1, num_waiting=3, kv_cache_usage=0.5)
    await ring.send_async(EngineOutputs([RequestDelta("b", [7, 8])], 0.0, stats, 0))
    async with anyio.create_task_group() as tg:
        tg.start_soon(replica.run)
        with anyio.fail_after(10):
            first = await merged.recv_async()
        assert first.outputs[0].new_token_ids == [7, 8]
        ready = replica.expect_generation(1)
        await ring.send_async(EngineOutputs([RequestDelta("b", [9])], 0.0, None, 0))  # stale
        await ring.send_async(EngineOutputs([], 0.0, SchedulerStats(), 1))  # the ready message
        await ring.send_async(EngineOutputs([RequestDelta("b", [9], finish_reason="length")],
                                            0.0, None, 1))
        with anyio.fail_after(10):
            while len(merged._queue) < 2:
                await anyio.sleep(0.01)
        # Forwarded, but not set until the Detokenizer takes the ready message.
        assert not ready.is_set()
        second = await merged.recv_async()
        assert ready.is_set()
        assert (second.outputs, second.generation) == ([], 0)
        third = await merged.recv_async()
        assert (third.outputs[0].new_token_ids, third.generation) == ([9], 0)
        tg.cancel_scope.cancel()
    assert replica.generation_tokens_total == 3  # the stale [9] is not counted
    assert router.owner("b") is None  # finished
    assert router.replicas[1].num_unfinished == 0


@pytest.mark.anyio
async def test_a_lost_replica_hands_its_requests_to_a_live_one() -> None:
    router = DPRouter(2, block_size=4, max_prefix_blocks=0)
    gates = [FakeGate(), FakeGate()]
    requests = DPRequests(router, gates)
    for i in range(4):
        await requests.send_async(_req(f"r{i}", [i] * 8))
    for g in gates:
        g.drain()
    # What the Detokenizer would resubmit: every live request with its delivered tokens.
    live = [_req(f"r{i}", [i] * 8, out=[100 + i]) for i in range(4)]
    dead = DeadSupervisor()
    lost_ring = gates[1].channel
    outputs = ReplicaOutputs(1, InprocChannel(), router, MergedOutputs())
    watcher = ReplicaWatcher(1, dead, outputs, router, requests, lambda: live)
    async with anyio.create_task_group() as tg:
        tg.start_soon(outputs.run)
        tg.start_soon(watcher.run)
        with anyio.fail_after(10):
            while not watcher.is_lost or len(gates[0].channel) < 2:
                await anyio.sleep(0.01)
        await anyio.sleep(0.05)  # the watcher and reader stay up (no task group error)
        moved = gates[0].drain()
        assert [(m.request_id, m.output_token_ids) for m in moved] == [("r1", [101]),
                                                                       ("r3", [103])]
        assert dead.stopped and watcher.is_lost
        assert not router.replicas[1].is_alive
        assert {router.owner(f"r{i}") for i in range(4)} == {0}
        # New work and late sends to the lost replica go nowhere near its ring.
        await requests.send_async(_req("new", [9] * 8))
        await gates[1].send_async(_req("late", [1]))
        assert [m.request_id for m in gates[0].drain()] == ["new"]
        assert len(lost_ring) == 0
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_the_last_replica_lost_kills_the_engine() -> None:
    router = DPRouter(1, block_size=4)
    requests = DPRequests(router, [FakeGate()])
    outputs = ReplicaOutputs(0, InprocChannel(), router, MergedOutputs())
    watcher = ReplicaWatcher(0, DeadSupervisor(), outputs, router, requests, lambda: [])
    with pytest.raises(EngineDeadError, match="every data-parallel replica is down"):
        await watcher.run()
