"""Lock-free shared-memory rings and the typed channels actors talk through (DESIGN.md §3).

    segment = create_ring("requests", 4 << 20, run_id=run_id)        # supervisor (owner)
    out = Channel(RingWriter.attach(segment.name), NewRequest)       # producer process
    inbox = Channel(RingReader.attach(segment.name), NewRequest)     # consumer process
    msg = await inbox.recv_async()

`InprocChannel` has the same interface for actors placed in one process.
"""

from __future__ import annotations

try:
    from flowengine.shm import _ring  # noqa: F401  (the compiled part of the rings)
except ImportError as exc:  # a source tree whose C extensions were never built
    import os as _os

    raise ImportError(
        f"flowengine.shm._ring, the compiled extension of the shared-memory rings, is "
        f"missing from {_os.path.dirname(_os.path.abspath(__file__))}: this flowengine is "
        "a source tree without its C extensions built. Install it (bash "
        "scripts/install.sh, or pip install -e . / pip install .); after a plain pip "
        "install ., start Python outside the clone (python -m puts the working "
        "directory first on sys.path)") from exc

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
