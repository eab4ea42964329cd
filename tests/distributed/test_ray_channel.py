"""The Ray backend's pieces that need no Ray (they run in CI): the driver's TCP relay
between the rings and a remote rank (msgspec bytes, secret checked), the actor's
TcpChannel, and the placement settings."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest

from flowengine.executor.ray_executor import (
    PLACEMENT_STRATEGY_ENV,
    TcpChannel,
    interface_of,
    placement_bundles,
    placement_strategy,
    read_frame,
    relay_rank,
    write_frame,
)
from flowengine.messages import ExecutorReady, ResultsMsg, Shutdown, StepsMsg
from flowengine.shm import (
    BroadcastWriter,
    Channel,
    RingReader,
    create_broadcast_ring,
    create_ring,
    new_run_id,
)


def _listener() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    return sock


@pytest.fixture
def rings():
    run_id = new_run_id()
    steps = create_broadcast_ring("steps", 2, 1 << 20, run_id=run_id)
    results = create_ring("results", 1 << 20, run_id=run_id)
    yield steps.name, results.name
    steps.close()
    results.close()


def test_relay_carries_plans_to_and_results_from_the_sampling_rank(rings) -> None:
    steps_name, results_name = rings
    token = b"k" * 32

    async def scenario() -> tuple:
        sock = _listener()
        port = sock.getsockname()[1]
        relay = asyncio.ensure_future(relay_rank(sock, token, steps_name, 1, results_name))
        # A peer without the secret is turned away and the relay keeps waiting.
        r0, w0 = await asyncio.open_connection("127.0.0.1", port)
        write_frame(w0, b"x" * 32)
        await w0.drain()
        rejected = await asyncio.wait_for(r0.read(), 10)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        write_frame(writer, token)
        await writer.drain()
        plans = Channel(BroadcastWriter.attach(steps_name), StepsMsg)
        await plans.send_async(Shutdown())
        got = await asyncio.wait_for(TcpChannel(reader, writer, StepsMsg).recv_async(), 10)
        await TcpChannel(reader, writer, ResultsMsg).send_async(ExecutorReady(7, 1))
        results = Channel(RingReader.attach(results_name), ResultsMsg)
        ready = await asyncio.wait_for(results.recv_async(), 10)
        writer.close()  # the rank is gone: the relay ends
        await asyncio.wait_for(relay, 10)
        # The relay detached from the results ring without closing it: the engine's
        # reader waits for the next group's writer (a ChannelClosedError here made the
        # restarted engine die, issue #18).
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(results.recv_async(), 0.3)
        return rejected, got, ready

    rejected, got, ready = asyncio.run(scenario())
    assert rejected == b""
    assert got == Shutdown()
    assert ready == ExecutorReady(7, 1)
    # The ended relay closed its ring ends: no waiter thread of its steps reader is left.
    assert not [t for t in threading.enumerate() if t.name == f"fe-wait{steps_name}-r1"]


def test_relay_refuses_results_from_a_rank_that_does_not_sample(rings) -> None:
    steps_name, _ = rings
    token = b"t" * 32

    async def scenario() -> None:
        sock = _listener()
        relay = asyncio.ensure_future(relay_rank(sock, token, steps_name, 0, None))
        reader, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
        write_frame(writer, token)
        await TcpChannel(reader, writer, ResultsMsg).send_async(ExecutorReady(3, 0))
        await asyncio.wait_for(relay, 10)

    with pytest.raises(RuntimeError, match="executor rank 0 sent results; only the sampling"):
        asyncio.run(scenario())


def test_frames_round_trip_and_oversized_frames_are_refused() -> None:
    async def scenario() -> tuple[bytes, str]:
        reader = asyncio.StreamReader()
        reader.feed_data(b"\x00\x00\x00\x03abc")
        first = await read_frame(reader)
        reader.feed_data((1 << 30).to_bytes(4, "big"))
        try:
            await read_frame(reader)
        except ValueError as exc:
            return first, str(exc)
        return first, ""

    first, error = asyncio.run(scenario())
    assert first == b"abc"
    assert error == f"frame of {1 << 30} bytes exceeds {64 << 20}"


def test_placement_one_bundle_per_stage_and_strategy(monkeypatch) -> None:
    assert placement_bundles(2, 3, gpus=False) == [{"CPU": 2.0}] * 3
    assert placement_bundles(4, 2, gpus=True) == [{"CPU": 4.0, "GPU": 4.0}] * 2
    monkeypatch.delenv(PLACEMENT_STRATEGY_ENV, raising=False)
    assert placement_strategy() == "PACK"
    monkeypatch.setenv(PLACEMENT_STRATEGY_ENV, "STRICT_SPREAD")
    assert placement_strategy() == "STRICT_SPREAD"
    monkeypatch.setenv(PLACEMENT_STRATEGY_ENV, "RANDOM")
    with pytest.raises(ValueError, match="FLOWENGINE_RAY_PLACEMENT_STRATEGY='RANDOM'"):
        placement_strategy()


def test_interface_of_an_address() -> None:
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("192.0.2.55") is None  # TEST-NET-1: on no interface


def test_kill_local_ranks_leaves_a_process_that_is_no_ray_worker(tmp_path) -> None:
    import os

    from flowengine.actors import supervisor
    from flowengine.executor import ray_executor

    assert supervisor.RAY_LOCAL_PIDS_ENV == ray_executor.LOCAL_PIDS_ENV
    pids_file = tmp_path / "pids"
    pids_file.write_text(f"{os.getpid()}\n")
    assert ray_executor.kill_local_ranks(str(pids_file), timeout_s=1.0) == []
    assert not pids_file.exists()
    assert ray_executor.kill_local_ranks(str(pids_file)) == []  # no file: nothing to do


def test_kill_slot_holders_frees_a_slot_an_old_process_still_holds() -> None:
    """Issue #18: after kill -9 of the remote rank, a process of the old group still
    held steps slot 1, so every restart's reset_reader raised "held by live pid".
    kill_slot_holders kills such a holder (not this process) and the reset passes."""
    import os
    import subprocess
    import sys

    from flowengine.executor.ray_executor import kill_slot_holders
    from flowengine.shm.segment import LIVE, RESERVED

    run_id = new_run_id()
    steps = create_broadcast_ring("steps", 2, 1 << 16, run_id=run_id)
    results = create_ring("results", 1 << 16, run_id=run_id)
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time\n"
         "from flowengine.shm import RingReader\n"
         f"r = RingReader.attach({steps.name!r}, reader_index=1)\n"
         "print('attached', flush=True)\n"
         "time.sleep(60)\n"],
        stdout=subprocess.PIPE, text=True)
    mine = RingReader.attach(steps.name, reader_index=0)  # this process: left alone
    try:
        assert holder.stdout.readline().strip() == "attached"
        assert steps.reader_state(1) == LIVE and steps.reader_pid(1) == holder.pid
        with pytest.raises(Exception, match="held by live pid"):
            steps.reset_reader(1)
        assert kill_slot_holders([steps, results], timeout_s=5.0) == [holder.pid]
        assert holder.wait(timeout=5) == -9
        steps.reset_reader(1)
        assert steps.reader_state(1) == RESERVED and steps.reader_pid(1) == 0
        assert steps.reader_pid(0) == os.getpid()  # not killed, still attached
        assert kill_slot_holders([steps, results], timeout_s=1.0) == []
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
        mine.close()
        steps.close()
        results.close()
