"""Broadcast ring: one writer, N readers that each see every record (the "steps" ring).

Each reader has its own cursor (its own cache line); the writer reuses bytes only
after the slowest *live* reader has passed them. A reader that dies cannot corrupt
the others (it only ever writes its own cursor line); the writer reaps it when the
ring fills up (its pid is gone), or anyone can `mark_reader_dead(i)`. A restarted
reader re-attaches to its slot at the current write cursor:

    segment = create_broadcast_ring("steps", num_readers=tp_size, run_id=run_id)
    writer = BroadcastWriter.attach(segment.name)          # scheduler process
    reader = RingReader.attach(segment.name, reader_index=rank)   # executor rank
"""

from __future__ import annotations

from flowengine.shm.doorbell import full_fence
from flowengine.shm.segment import (
    DEAD,
    DEFAULT_CAPACITY_BYTES,
    R_STATE,
    RingSegment,
    reader_ctl_word,
    reader_cursor_word,
)
from flowengine.shm.writer import RingWriter


def create_broadcast_ring(
    ring_name: str,
    num_readers: int,
    capacity_bytes: int = DEFAULT_CAPACITY_BYTES,
    *,
    run_id: str | None = None,
) -> RingSegment:
    """Create a broadcast ring segment with `num_readers` reader slots, owned by the caller.

    Every slot starts RESERVED: records are kept for a reader that has not attached yet.
    Raises ValueError on bad sizes/names, RingError if the name exists.
    """
    return RingSegment.create(
        ring_name, capacity_bytes=capacity_bytes, num_readers=num_readers, run_id=run_id
    )


class BroadcastWriter(RingWriter):
    """The single writer of a broadcast ring; every live reader receives every record.

    Same API as RingWriter (try_send, send, send_async, close, reap_dead_readers,
    mark_reader_dead); room is bounded by the slowest reader that is not DEAD.
    """

    def _refresh_limit(self) -> None:
        full_fence()  # see RingWriter._refresh_limit
        q = self._q
        slowest = None
        for i in range(self.segment.num_readers):
            if q[reader_ctl_word(i) + R_STATE] != DEAD:
                cursor = q[reader_cursor_word(i)]
                if slowest is None or cursor < slowest:
                    slowest = cursor
        # With every reader dead there is nobody to wait for: records go nowhere.
        self._limit = (self._w if slowest is None else slowest) + self._cap
        self._fast_end = min(self._lap_end, self._limit)

    def live_readers(self) -> list[int]:
        """Indices of the reader slots the writer waits for (RESERVED or LIVE)."""
        return [i for i in range(self.segment.num_readers) if self.segment.reader_state(i) != DEAD]

    def lag_bytes(self) -> dict[int, int]:
        """Bytes each live reader is behind the write cursor, as far as it has published
        its cursor (readers publish every capacity/8 bytes and when caught up)."""
        return {i: self._w - self._q[reader_cursor_word(i)] for i in self.live_readers()}
