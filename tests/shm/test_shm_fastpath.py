"""The C fast paths (flowengine/shm/_ring.c): payload types, arguments, exact cursor
accounting, use after close, and that closing both ends lets the mapping go."""

from __future__ import annotations

import array
import threading
import time

import pytest

from flowengine.shm import ChannelClosedError, RingReader, RingWriter, create_ring
from flowengine.shm.record import record_bytes


@pytest.fixture
def ring(run_id: str):
    segment = create_ring("f", 4096, run_id=run_id)
    writer, reader = RingWriter(segment), RingReader(segment)
    yield writer, reader
    reader.close()
    writer.close()
    segment.close()


def test_any_contiguous_bytes_like_payload(ring) -> None:
    writer, reader = ring
    words = array.array("q", [1, -2, 3])
    backing = bytearray(b"0123456789")
    writer.send(bytearray(b"from a bytearray"))
    writer.send(memoryview(backing)[2:6])
    writer.send(memoryview(words))  # the payload is the raw bytes, not 3 items
    assert writer.try_send(b"bytes")
    assert reader.recv_many(timeout_s=1) == [
        b"from a bytearray",
        b"2345",
        words.tobytes(),
        b"bytes",
    ]
    with pytest.raises(TypeError):
        writer.send("text is not bytes")
    with pytest.raises(TypeError):
        writer.try_send(12)
    with pytest.raises(BufferError):
        writer.send(memoryview(backing)[::2])  # not contiguous
    assert reader.try_recv() is None  # the failed sends wrote nothing


def test_cursors_advance_by_exact_record_sizes(ring) -> None:
    writer, reader = ring
    sizes = [0, 1, 7, 8, 9, 100]
    start = writer._w
    for n in sizes:
        writer.send(bytes([n % 256]) * n)
    assert writer._w - start == sum(record_bytes(n) for n in sizes) == 8 + 16 + 16 + 16 + 24 + 112
    got = [reader.try_recv() for _ in range(3)] + reader.try_recv_many()
    assert [len(data) for data in got] == sizes
    assert reader._r == writer._w
    assert reader.try_recv() is None and reader.try_recv_many() == []
    # Caught up: the reader handed all room back to the writer.
    assert reader._published == writer._w


def test_argument_errors(ring) -> None:
    writer, reader = ring
    writer.send(b"a", 1.0)
    writer.send(b"b", timeout_s=None)
    with pytest.raises(TypeError, match="timeout_s"):
        writer.send()
    with pytest.raises(TypeError, match="unexpected keyword argument 'timeout'"):
        writer.send(b"c", timeout=1)
    with pytest.raises(TypeError):
        writer.send(b"c", 1, 2)
    assert reader.recv(1.0) == b"a"
    assert reader.recv(timeout_s=1.0) == b"b"
    with pytest.raises(TypeError, match="unexpected keyword argument 'block'"):
        reader.recv_many(block=True)
    with pytest.raises(TimeoutError):
        reader.recv_many(timeout_s=0.01)


def test_use_after_close_raises_channel_closed(run_id: str) -> None:
    segment = create_ring("c", 4096, run_id=run_id)
    writer, reader = RingWriter(segment), RingReader(segment)
    writer.send(b"kept")
    reader.close()
    writer.close()
    with pytest.raises(ChannelClosedError, match="writer closed"):
        writer.send(b"late")
    with pytest.raises(ChannelClosedError, match="writer closed"):
        writer.try_send(b"late")
    for receive in (reader.try_recv, reader.try_recv_many, reader.recv, reader.recv_many):
        with pytest.raises(ChannelClosedError, match="reader closed"):
            receive()
    # Neither end holds the mapping any more, so closing the segment unmaps it.
    segment.close()
    assert segment.mm.closed


def test_reader_sleeping_in_recv_is_woken_by_each_send(ring) -> None:
    # Every round the reader goes to sleep on its doorbell (the writer waits past the
    # 50 us spin phase), and the C send must ring it.
    writer, reader = ring
    received: list[bytes] = []

    def read() -> None:
        for _ in range(20):
            received.append(reader.recv(timeout_s=5))

    thread = threading.Thread(target=read)
    thread.start()
    for i in range(20):
        time.sleep(0.005)
        writer.send(b"%d" % i)
    thread.join(10)
    assert not thread.is_alive()
    assert received == [b"%d" % i for i in range(20)]
