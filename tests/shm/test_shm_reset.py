"""`RingSegment.reset_reader`: the restart handshake's guarantee (DESIGN.md §8, issue #21
item 2). A reader that re-attaches to a dead reader's slot starts at the write cursor,
so a one-shot message written before it attached is missed; after a reset, the slot
keeps every record written from then on for its next reader, however late it attaches.
"""

from __future__ import annotations

import pytest

from flowengine.shm import (
    BroadcastWriter,
    RingError,
    RingReader,
    RingWriter,
    create_broadcast_ring,
    create_ring,
)
from flowengine.shm.segment import LIVE, RESERVED


def test_reattached_reader_misses_what_was_written_before(run_id):
    segment = create_ring("t", 4096, run_id=run_id)
    try:
        writer = RingWriter(segment)
        RingReader(segment).close()  # a previous reader, gone (its slot DEAD)
        writer.send(b"ready")
        late = RingReader(segment)
        assert late.try_recv() is None  # the known behaviour the reset exists for
        late.close()
        writer.close()
    finally:
        segment.close()


def test_reset_slot_keeps_records_for_a_late_reader(run_id):
    segment = create_ring("t", 4096, run_id=run_id)
    try:
        writer = RingWriter(segment)
        writer.send(b"old")
        first = RingReader(segment)
        assert first.try_recv() == b"old"
        with pytest.raises(RingError, match="held by live pid"):
            segment.reset_reader(0)  # this live process still holds it
        first.close()
        writer.send(b"lost")  # written while nobody is attached and before the reset
        writer.close()
        segment.reset_reader(0)
        assert segment.reader_state(0) == RESERVED and segment.reader_pid(0) == 0
        successor = RingWriter(segment)
        successor.send(b"ready")
        successor.send(b"second")
        late = RingReader(segment)
        assert segment.reader_state(0) == LIVE
        assert late.try_recv() == b"ready"
        assert late.try_recv() == b"second"
        assert late.try_recv() is None
        late.close()
        successor.close()
    finally:
        segment.close()


def test_reset_every_slot_of_a_broadcast_ring(run_id):
    segment = create_broadcast_ring("b", 3, 4096, run_id=run_id)
    try:
        readers = [RingReader(segment, reader_index=i) for i in range(3)]
        for r in readers:
            r.close()
        for i in range(3):
            segment.reset_reader(i)
        with pytest.raises(ValueError, match="reader_index 3 outside 0..2"):
            segment.reset_reader(3)
        writer = BroadcastWriter(segment)
        writer.send(b"plan")
        late = [RingReader(segment, reader_index=i) for i in range(3)]
        assert [r.try_recv() for r in late] == [b"plan"] * 3
        for r in late:
            r.close()
        writer.close()
    finally:
        segment.close()
