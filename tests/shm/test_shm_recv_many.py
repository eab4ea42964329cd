"""Batched reads (`RingReader.try_recv_many` / `recv_many` / `recv_many_async`) and the
channel that reads through them: same records, same order, same errors as `recv`."""

from __future__ import annotations

import asyncio
import random
import threading

import msgspec
import pytest
from shm_workers import Ping, check_record, make_record

from flowengine.shm import (
    BroadcastWriter,
    Channel,
    ChannelClosedError,
    ReaderDetachedError,
    RingReader,
    RingWriter,
    create_broadcast_ring,
    create_ring,
)
from flowengine.shm.reader import MAX_BATCH_BYTES


def test_try_recv_many_returns_every_published_record_in_order(ring) -> None:
    writer, reader = ring
    assert reader.try_recv_many() == []
    payloads = [b"", b"a", b"12345678", b"x" * 1000, b"tail"]
    for payload in payloads:
        writer.send(payload)
    assert reader.try_recv_many() == payloads
    assert reader.try_recv_many() == []
    writer.send(b"one")
    assert reader.recv_many(timeout_s=1) == [b"one"]


def test_random_sizes_wrap_around_in_batches(ring) -> None:
    # The writer fills the 4 KiB ring, the reader takes everything published in one
    # call: batches end at wrap markers, at the lap's last byte and mid-lap.
    writer, reader = ring
    rng = random.Random()
    next_seq = expected = 0
    batch_sizes = set()
    while expected < 5000:
        while next_seq < 5000 and writer.try_send(make_record(next_seq, rng.randrange(0, 1200))):
            next_seq += 1
        batch = reader.try_recv_many()
        batch_sizes.add(len(batch))
        for data in batch:
            assert check_record(data, expected) == expected
            expected += 1
    assert reader.try_recv_many() == []
    assert len(batch_sizes - {0, 1}) > 0, "no batch of several records was read"


def test_recv_many_timeout_and_close(ring) -> None:
    writer, reader = ring
    with pytest.raises(TimeoutError, match="no record within"):
        reader.recv_many(timeout_s=0.05)
    writer.send(b"last")
    writer.send(b"really last")
    writer.close()
    assert reader.recv_many(timeout_s=1) == [b"last", b"really last"]  # drained first
    with pytest.raises(ChannelClosedError):
        reader.recv_many(timeout_s=1)


def test_recv_many_is_woken_by_a_writer_thread(ring) -> None:
    writer, reader = ring
    timer = threading.Timer(0.2, writer.send, args=(b"wake",))
    timer.start()
    assert reader.recv_many(timeout_s=5) == [b"wake"]
    timer.join()


def test_detached_batch_reader_raises(run_id: str) -> None:
    segment = create_broadcast_ring("steps", 2, 4096, run_id=run_id)
    try:
        writer = BroadcastWriter(segment)
        first, second = RingReader(segment, 0), RingReader(segment, 1)
        writer.send(b"both")
        assert second.try_recv_many() == [b"both"]
        writer.send(b"again")
        writer.mark_reader_dead(0)
        with pytest.raises(ReaderDetachedError):
            first.try_recv_many()
        assert second.try_recv_many() == [b"again"]
        first.close()
        second.close()
        writer.close()
    finally:
        segment.close()


def test_recv_many_async_cancel_consumes_nothing(ring) -> None:
    writer, reader = ring

    async def main() -> list[bytes]:
        waiting = asyncio.create_task(reader.recv_many_async())
        await asyncio.sleep(0.1)  # past the spin: now waiting in the helper thread
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        writer.send(b"after cancel")
        writer.send(b"second")
        return await asyncio.wait_for(reader.recv_many_async(), 5)

    assert asyncio.run(main()) == [b"after cancel", b"second"]


def test_channel_decodes_a_burst_one_message_at_a_time(run_id: str) -> None:
    segment = create_ring("msgs", 1 << 16, run_id=run_id)
    try:
        raw = RingWriter(segment)
        out = Channel(raw, Ping)
        inbox = Channel(RingReader(segment), Ping)
        out.send(Ping(0, [1]))
        raw.send(b"\xc1 not msgpack")  # an invalid message in the middle of a burst
        out.send(Ping(2, [3]))

        async def send_and_receive() -> list[Ping]:
            await out.send_async(Ping(3, [4, 5]))
            return [await inbox.recv_async()]

        assert inbox.try_recv() == Ping(0, [1])  # one ring read took all three records
        assert reader_is_drained(inbox)
        with pytest.raises(msgspec.DecodeError):
            inbox.recv(timeout_s=1)  # fails at its own turn ...
        assert inbox.recv(timeout_s=1) == Ping(2, [3])  # ... and loses nothing after it
        assert asyncio.run(send_and_receive()) == [Ping(3, [4, 5])]
        assert inbox.try_recv() is None
        out.close()
        with pytest.raises(ChannelClosedError):
            inbox.recv(timeout_s=1)
        inbox.close()
    finally:
        segment.close()


def reader_is_drained(channel: Channel) -> bool:
    """The ring has nothing left for this channel's reader (its records are buffered)."""
    return channel.ring.try_recv() is None


def test_a_batch_stops_after_the_record_crossing_max_batch_bytes(run_id: str) -> None:
    segment = create_ring("big", 1 << 20, run_id=run_id)
    try:
        writer, reader = RingWriter(segment), RingReader(segment)
        size = 40 << 10  # 64 KiB budget: the 2nd record starts inside it, the 3rd past it
        assert 2 * size > MAX_BATCH_BYTES > size + 8
        records = [bytes([i]) * size for i in range(3)]
        for record in records:
            writer.send(record)
        assert reader.try_recv_many() == records[:2]
        assert reader.try_recv_many() == records[2:]
        assert reader.try_recv_many() == []
        reader.close()
        writer.close()
    finally:
        segment.close()
