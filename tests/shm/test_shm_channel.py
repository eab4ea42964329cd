"""Typed channels: msgspec over rings (also across processes) and the in-process twin."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import threading

import msgspec
import pytest
import shm_workers
from shm_workers import Ping, Summary

from flowengine.shm import (
    Channel,
    ChannelClosedError,
    InprocChannel,
    MessageChannel,
    RecordTooLargeError,
    RingReader,
    RingWriter,
    create_ring,
)


def test_structs_round_trip_through_a_ring(run_id: str) -> None:
    segment = create_ring("msgs", 1 << 16, run_id=run_id)
    try:
        out = Channel(RingWriter(segment), Ping)
        inbox = Channel(RingReader(segment), Ping)
        sent = [Ping(0, [1, 2, 3]), Ping(1, [], text="héllo", logprob=-0.5), Ping(2, [7] * 500)]
        for msg in sent:
            out.send(msg)
        assert out.try_send(Ping(3, [4]))
        assert [inbox.recv(timeout_s=1) for _ in sent] == sent
        assert inbox.try_recv() == Ping(3, [4])
        assert inbox.try_recv() is None
        with pytest.raises(TypeError, match="receiving end"):
            inbox.send(Ping(9, []))
        with pytest.raises(TypeError, match="sending end"):
            out.recv()
        with pytest.raises(RecordTooLargeError):
            out.send(Ping(4, list(range(100_000))))
        out.close()
        with pytest.raises(ChannelClosedError):
            inbox.recv(timeout_s=1)
        inbox.close()
    finally:
        segment.close()


def test_wrong_schema_is_rejected_not_executed(run_id: str) -> None:
    segment = create_ring("msgs", 4096, run_id=run_id)
    try:
        with RingWriter(segment) as raw, RingReader(segment) as reader:
            inbox = Channel(reader, Ping)
            raw.send(msgspec.msgpack.encode(Summary(1, 2, "x")))  # another message type
            with pytest.raises(msgspec.ValidationError):
                inbox.recv(timeout_s=1)
            raw.send(b"\xc1 not msgpack")
            with pytest.raises(msgspec.DecodeError):
                inbox.recv(timeout_s=1)
    finally:
        segment.close()


def test_channel_across_processes(run_id: str) -> None:
    to_child = create_ring("pings", 1 << 16, run_id=run_id)
    from_child = create_ring("sums", 4096, run_id=run_id)
    try:
        process = mp.get_context("spawn").Process(
            target=shm_workers.sum_pings, args=(to_child.name, from_child.name)
        )
        process.start()
        replies = Channel(RingReader(from_child), Summary)
        out = Channel(RingWriter(to_child), Ping)
        for seq in range(20_000):
            out.send(Ping(seq, [seq, 1], text=f"t{seq}"), timeout_s=30)
        out.close()  # the child sees ChannelClosedError after the last Ping
        assert replies.recv(timeout_s=60) == Summary(20_000, sum(range(20_000)) + 20_000, "t19999")
        process.join(30)
        assert process.exitcode == 0
        replies.close()
    finally:
        to_child.close()
        from_child.close()


def test_inproc_channel_sync_and_roundtrip() -> None:
    channel: MessageChannel[Ping] = InprocChannel(Ping, roundtrip=True)
    msg = Ping(1, [1, 2])
    channel.send(msg)
    got = channel.recv(timeout_s=1)
    assert got == msg and got is not msg  # encoded and decoded, like a ring
    assert channel.try_recv() is None
    with pytest.raises(TimeoutError):
        channel.recv(timeout_s=0.01)
    mismatched = InprocChannel(Ping, roundtrip=True)
    mismatched.send(Summary(1, 2, "x"))  # type: ignore[arg-type]
    with pytest.raises(msgspec.ValidationError):
        mismatched.recv()  # rejected by the receiver, as on a ring
    by_reference = InprocChannel(Ping)
    by_reference.send(msg)
    assert by_reference.recv() is msg
    channel.send(Ping(2, []))
    channel.close()
    assert channel.recv() == Ping(2, [])  # drained first
    with pytest.raises(ChannelClosedError):
        channel.recv()
    with pytest.raises(ChannelClosedError):
        channel.send(msg)


def test_inproc_channel_async_backpressure_and_cancel() -> None:
    channel: InprocChannel[int] = InprocChannel(maxsize=2)

    async def main() -> list[int]:
        waiting = asyncio.create_task(channel.recv_async())
        await asyncio.sleep(0.01)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await channel.send_async(1)
        await channel.send_async(2)
        assert not channel.try_send(3)
        blocked = asyncio.create_task(channel.send_async(3))
        await asyncio.sleep(0.01)
        assert not blocked.done()  # full: the sender waits
        got = [await channel.recv_async()]
        await asyncio.wait_for(blocked, 1)
        got += [await channel.recv_async(), await channel.recv_async()]
        # A send from another thread wakes a receiver on this loop.
        threading.Timer(0.05, channel.send, args=(4,)).start()
        got.append(await asyncio.wait_for(channel.recv_async(), 5))
        closer = asyncio.create_task(channel.recv_async())
        await asyncio.sleep(0.01)
        channel.close()
        with pytest.raises(ChannelClosedError):
            await closer
        return got

    assert asyncio.run(main()) == [1, 2, 3, 4]
