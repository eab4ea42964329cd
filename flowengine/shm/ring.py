"""Point-to-point ring: one writer process, one reader process, lock-free.

The writer appends length-prefixed records (`record.py`) to a shared-memory segment
(`segment.py`) and publishes them by advancing its cursor; the reader consumes them
and advances its own. Both spin briefly and then sleep on doorbells (`doorbell.py`):
an idle endpoint costs ~no CPU, a full ring makes the writer wait (backpressure).

    segment = create_ring("requests", 4 << 20, run_id=run_id)   # supervisor, owner
    writer = RingWriter.attach(segment.name)                     # producer process
    reader = RingReader.attach(segment.name)                     # consumer process
"""

from __future__ import annotations

from flowengine.shm.reader import RingReader
from flowengine.shm.segment import DEFAULT_CAPACITY_BYTES, RingSegment
from flowengine.shm.writer import RingWriter

__all__ = ["RingReader", "RingWriter", "create_ring"]


def create_ring(
    ring_name: str, capacity_bytes: int = DEFAULT_CAPACITY_BYTES, *, run_id: str | None = None
) -> RingSegment:
    """Create a point-to-point ring segment (one reader slot), owned by the caller.

    Args:
        ring_name: [A-Za-z0-9_]+, e.g. "requests".
        capacity_bytes: data area in bytes (multiple of 8, >= 64); the largest record
            payload is capacity_bytes - 8.
        run_id: namespace of this engine run (default: a fresh random id).
    Raises:
        ValueError: bad sizes or names. RingError: the name exists already.
    """
    return RingSegment.create(
        ring_name, capacity_bytes=capacity_bytes, num_readers=1, run_id=run_id
    )
