"""The C fast paths (flowengine/shm/_ring.c): payload types, arguments, exact cursor
accounting, use after close, and that closing both ends lets the mapping go."""

from __future__ import annotations

import array
import struct
import subprocess
import sys
import threading
import time

import pytest

from flowengine.shm import (
    ChannelClosedError,
    ReaderDetachedError,
    RingError,
    RingReader,
    RingWriter,
    create_ring,
)
from flowengine.shm._ring import ReaderCore, WriterCore
from flowengine.shm.record import record_bytes
from flowengine.shm.segment import WRITER_ASLEEP_W, reader_cursor_word


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


def _overwrite_under_detached_reader(writer: RingWriter, length_word: int) -> None:
    # The reader stands at lap offset 16; the writer fills lap 0 and writes a record at
    # the start of lap 1 whose payload puts `length_word` exactly where the reader will
    # look for its next record's length.
    writer.send(b"F" * (4096 - 32 - 8))
    writer.send(bytes(8) + struct.pack("<q", length_word) + bytes(8))


@pytest.mark.parametrize("batched", [False, True])
@pytest.mark.parametrize("length_word", [1 << 32, 5000, -1, -7])
def test_detached_reader_never_trusts_an_overwritten_length(
    run_id: str, batched: bool, length_word: int
) -> None:
    # A huge length must not make the C reader copy past the mapping; a fake wrap
    # marker must not make it publish into the slot its successor now owns.
    segment = create_ring("d", 4096, run_id=run_id)
    writer, old = RingWriter(segment), RingReader(segment)
    writer.send(b"A" * 8)
    writer.send(b"B" * 8)
    assert old.try_recv() == b"A" * 8
    segment.mark_reader_dead(0)
    successor = RingReader(segment, 0)
    _overwrite_under_detached_reader(writer, length_word)
    with pytest.raises(ReaderDetachedError):
        old.try_recv_many() if batched else old.try_recv()
    # The successor's room is intact: the writer cannot overwrite what it has not read.
    assert segment.words[reader_cursor_word(0)] == successor._r
    assert not writer.try_send(b"x" * 8)
    assert successor.try_recv_many()[0] == b"F" * (4096 - 40)
    successor.close()
    old.close()
    writer.close()
    segment.close()


class _ClosingReader(RingReader):
    """Closes itself while the C code is inside a call (as another thread could)."""

    armed = False

    def _wake_writer(self) -> None:
        super()._wake_writer()
        if self.armed:
            self.close()


@pytest.mark.parametrize("batched", [False, True])
def test_reader_closed_inside_a_call_raises_instead_of_crashing(run_id: str, batched) -> None:
    segment = create_ring("k", 4096, run_id=run_id)
    writer, reader = RingWriter(segment), _ClosingReader(segment)
    if batched:
        for _ in range(20):  # 20 x 112 B > 4096 / 8: publishes inside the batch
            writer.send(b"x" * 100)
    else:
        writer.send(b"a" * 3000)
        assert reader.try_recv() == b"a" * 3000
        writer.send(b"b" * 1100)  # does not fit before the lap end: a wrap marker first
    segment.words[WRITER_ASLEEP_W] = 1  # so that publishing calls _wake_writer
    reader.armed = True
    with pytest.raises(ChannelClosedError, match="reader closed"):
        reader.try_recv_many() if batched else reader.try_recv()
    writer.close()
    segment.close()
    assert segment.mm.closed


class _InterruptedReader(RingReader):
    fail = False

    def _wake_writer(self) -> None:
        if self.fail:
            self.fail = False
            raise KeyboardInterrupt


def test_exception_while_publishing_never_rereads_freed_room(run_id: str) -> None:
    # An exception out of the doorbell call (Ctrl-C, say) may lose the batch it
    # interrupted, but the reader must not read room it already handed back.
    segment = create_ring("i", 4096, run_id=run_id)
    writer, reader = RingWriter(segment), _InterruptedReader(segment)
    for i in range(30):
        writer.send(bytes([i]) * 100)
    segment.words[WRITER_ASLEEP_W] = 1
    reader.fail = True
    with pytest.raises(KeyboardInterrupt):
        reader.try_recv_many()
    assert reader._r == reader._published == segment.words[reader_cursor_word(0)] > 0
    first_unread = reader._r // 112  # records of 100 bytes take 112
    while writer.try_send(b"\xee" * 100):
        pass
    got = reader.try_recv_many() + reader.try_recv_many()
    assert all(data == bytes([data[0]]) * 100 for data in got)  # intact, none overwritten
    assert [data[0] for data in got if data[0] != 0xEE] == list(range(first_unread, 30))
    reader.close()
    writer.close()
    segment.close()


def test_core_bind_checks_its_arguments() -> None:
    buffer = bytearray(4096)
    with pytest.raises(ValueError, match="outside"):
        WriterCore()._bind(buffer, 2**61 - 1, 0)
    with pytest.raises(ValueError, match="geometry"):
        ReaderCore()._bind(buffer, 0, 1, 2, 3, 2**62, 2**62, 1)
    with pytest.raises(ChannelClosedError, match="never attached"):
        WriterCore().try_send(b"x")
    with pytest.raises(ChannelClosedError, match="never attached"):
        ReaderCore().try_recv_many()


def test_waiting_send_counts_bytes_not_items(run_id: str) -> None:
    # A full ring and an array payload of 400 8-byte items: the wait must be for
    # 3,200 bytes of room, so it times out instead of spinning on "room for 400".
    segment = create_ring("n", 4096, run_id=run_id)
    writer, reader = RingWriter(segment), RingReader(segment)
    for _ in range(7):
        writer.send(b"f" * 500)
    started = time.process_time()
    with pytest.raises(TimeoutError):
        writer.send(array.array("q", [1] * 400), timeout_s=0.3)
    assert time.process_time() - started < 0.2  # slept on the doorbell, no busy loop
    assert len(reader.try_recv_many()) == 7
    writer.send(array.array("q", [1] * 400), timeout_s=1)
    assert reader.recv(timeout_s=1) == array.array("q", [1] * 400).tobytes()
    reader.close()
    writer.close()
    segment.close()


def test_batch_of_only_a_wrap_marker_hands_the_room_back(ring) -> None:
    # The reader is asleep in recv_many when the writer puts a wrap marker and then
    # waits for the whole next lap: the reader must publish the room behind the marker
    # before sleeping again, or both wait forever.
    writer, reader = ring
    writer.send(b"a" * 4000)  # 4,008 bytes; 88 left in the lap
    assert reader.recv_many() == [b"a" * 4000]
    got: list[list[bytes]] = []
    thread = threading.Thread(target=lambda: got.append(reader.recv_many(timeout_s=10)))
    thread.start()
    time.sleep(0.2)  # the reader caught up and went to sleep
    writer.send(b"b" * 4088, timeout_s=5)  # a wrap marker, then a record filling a lap
    thread.join(10)
    assert got == [[b"b" * 4088]]


_LAPPED_MID_BATCH = """
import struct, sys
from flowengine.shm import ReaderDetachedError, RingReader, RingWriter, create_ring
from flowengine.shm.segment import WRITER_ASLEEP_W
segment = create_ring("lap", 4096, run_id=sys.argv[1])
writer = RingWriter(segment)

class Reader(RingReader):
    hooked = False

    def _wake_writer(self):
        # Mid-batch: the reader is detached and lapped; a -1 word lands where the
        # reader looks for its next record's length (lap offset 560).
        if not self.hooked:
            self.hooked = True
            segment.mark_reader_dead(0)
            writer.send(b"F" * 728)
            writer.send(bytes(552) + struct.pack("<q", -1) + bytes(40))

reader = Reader(segment)
for _ in range(30):
    writer.send(b"x" * 100)
segment.words[WRITER_ASLEEP_W] = 1
try:
    reader.try_recv_many()
except ReaderDetachedError:
    print("detached")
reader.close(); writer.close(); segment.close()
"""


def test_reader_lapped_mid_batch_raises_instead_of_spinning(run_id: str) -> None:
    # In a subprocess: the defect was an endless loop holding the GIL.
    result = subprocess.run(
        [sys.executable, "-c", _LAPPED_MID_BATCH, run_id],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "detached"


def test_corrupt_private_state_never_writes_outside_the_ring(ring) -> None:
    writer, reader = ring
    writer._fast_end = 1 << 40
    with pytest.raises(RuntimeError, match="corrupt"):
        writer.send(b"x" * (1 << 20))
    reader._r = -4000
    with pytest.raises(RingError, match="corrupt"):
        reader.try_recv()
    with pytest.raises(RingError, match="corrupt"):
        reader.try_recv_many()


def test_timeout_must_be_a_number(ring) -> None:
    writer, reader = ring
    with pytest.raises(TypeError, match="timeout_s must be a number"):
        writer.send(b"x", timeout_s="1")
    with pytest.raises(TypeError, match="timeout_s must be a number"):
        reader.recv("1")
    assert reader.try_recv() is None  # the refused send wrote nothing
