"""Lock-free shared-memory rings and the typed channels actors talk through (DESIGN.md §3).

    segment = create_ring("requests", 4 << 20, run_id=run_id)        # supervisor (owner)
    out = Channel(RingWriter.attach(segment.name), NewRequest)       # producer process
    inbox = Channel(RingReader.attach(segment.name), NewRequest)     # consumer process
    msg = await inbox.recv_async()

`InprocChannel` has the same interface for actors placed in one process.
"""

from __future__ import annotations

from flowengine.shm.broadcast import BroadcastWriter, create_broadcast_ring
from flowengine.shm.codec import Channel, MessageChannel
from flowengine.shm.errors import (
    ChannelClosedError,
    ReaderDetachedError,
    RecordTooLargeError,
    RingError,
)
from flowengine.shm.inproc import InprocChannel
from flowengine.shm.reader import RingReader
from flowengine.shm.ring import create_ring
from flowengine.shm.segment import RingSegment, cleanup_stale, new_run_id, segment_name
from flowengine.shm.writer import RingWriter

__all__ = [
    "BroadcastWriter",
    "Channel",
    "ChannelClosedError",
    "InprocChannel",
    "MessageChannel",
    "ReaderDetachedError",
    "RecordTooLargeError",
    "RingError",
    "RingReader",
    "RingSegment",
    "RingWriter",
    "cleanup_stale",
    "create_broadcast_ring",
    "create_ring",
    "new_run_id",
    "segment_name",
]
