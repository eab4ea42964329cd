"""The reading end of a ring (see record.py for the format and memory-ordering NOTE).

The same class reads a point-to-point ring (reader_index 0) and one slot of a
broadcast ring.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Self, TypeVar

from flowengine.shm.async_wait import AsyncWaiter
from flowengine.shm.doorbell import SPIN_NS
from flowengine.shm.errors import ChannelClosedError, ReaderDetachedError
from flowengine.shm.record import HEADER_BYTES
from flowengine.shm.segment import (
    CLOSED_W,
    R_TOKEN,
    WRITE_CURSOR_W,
    WRITER_ASLEEP_W,
    RingSegment,
    reader_ctl_word,
    reader_cursor_word,
)

T = TypeVar("T")

# Bytes one try_recv_many call reads at most (it stops after the record crossing it).
# Bounds the memory a batch holds, and keeps the batch's payloads below glibc's heap
# trim threshold (128 KiB): freeing megabytes of payloads at once made malloc return
# the heap top to the kernel and fault it back in for the next batch, which cost
# 80 us per 64 KiB record against 4 us read one at a time.
MAX_BATCH_BYTES = 64 << 10


class RingReader:
    """Reader `reader_index` of a ring. One thread or task at a time.

    Attaching claims the slot: a slot never attached before starts at the oldest
    record kept for it (nothing sent earlier is lost); a slot whose previous reader died
    or was detached restarts at the current write cursor.

    Args:
        segment: the mapped segment; with `own_segment` close() also unmaps it.
        reader_index: 0 for a point-to-point ring; 0..num_readers-1 for a broadcast ring.
    Raises:
        ValueError: reader_index out of range. RingError: slot held by a live process.
    """

    def __init__(
        self, segment: RingSegment, reader_index: int = 0, *, own_segment: bool = False
    ) -> None:
        self.segment = segment
        self.name = segment.name
        self.reader_index = reader_index
        self._own_segment = own_segment
        self._mm = segment.mm
        self._q = segment.words
        self._cap = segment.capacity_bytes
        self._data_off = segment.data_offset
        self._cursor_w = reader_cursor_word(reader_index)
        self._token_w = reader_ctl_word(reader_index) + R_TOKEN
        self._r, self._token = segment.claim_reader(reader_index)
        self._bell = segment.reader_bell(reader_index)
        self._writer_bell = segment.writer_bell()
        self._cached_w = self._r  # last write cursor seen; reloaded only when caught up
        # The read cursor is published (stored for the writer) only every
        # _publish_bytes of records and whenever the reader catches up, so the writer
        # may see up to an eighth of the ring as still in use.
        self._published = self._r
        self._publish_bytes = self._cap // 8
        self._waiter: AsyncWaiter | None = None
        self._closed = False

    @classmethod
    def attach(cls, name: str, reader_index: int = 0) -> Self:
        """Attach by segment name (e.g. in a spawned process); close() unmaps."""
        segment = RingSegment.attach(name)
        try:
            return cls(segment, reader_index, own_segment=True)
        except BaseException:
            segment.close()
            raise

    def try_recv(self) -> bytes | None:
        """Return the next record's payload, or None if there is none now.

        Raises ReaderDetachedError if this reader was marked dead.
        """
        r = self._r
        if r == self._cached_w:
            self._cached_w = self._q[WRITE_CURSOR_W]
            if r == self._cached_w:
                if r != self._published:
                    self._publish(r)  # caught up: hand all room back before idling
                return None
        q = self._q
        base = self._data_off + r % self._cap
        n = q[base >> 3]
        if n < 0:
            return self._skip_wrap()
        data = self._mm[base + HEADER_BYTES : base + HEADER_BYTES + n]
        # Checked after the copy: our slot's token is cleared (marked dead, or taken by a
        # successor) before the writer may overwrite our records, so (TSO, loads in
        # order) a copy that saw overwritten bytes also sees the token gone.
        if q[self._token_w] != self._token:
            raise self._detached()
        r += (n + 15) & -8
        self._r = r
        if r - self._published > self._publish_bytes:
            self._publish(r)
        return data

    def _skip_wrap(self) -> bytes | None:
        # A wrap marker: the next record starts at the beginning of the next lap.
        r = self._r
        self._r = r = r + self._cap - r % self._cap
        if r - self._published > self._publish_bytes:
            self._publish(r)
        return self.try_recv()

    def try_recv_many(self) -> list[bytes]:
        """Every record published now, oldest first; [] if none (at most the ring's
        capacity in bytes).

        One load of the write cursor and one detach check for the whole batch, so a
        record costs a slice copy and a list append: the engine's channels read this
        way (codec.Channel). Raises ReaderDetachedError if this reader was marked dead.
        """
        q = self._q
        r = self._r
        w = q[WRITE_CURSOR_W]
        if r == w:
            if r != self._published:
                self._publish(r)  # caught up: hand all room back before idling
            return []
        self._cached_w = w
        mm = self._mm
        cap = self._cap
        records: list[bytes] = []
        budget = MAX_BATCH_BYTES
        while r != w and budget > 0:
            # The records of this lap lie back to back from pos: the inner loop has no
            # wrap arithmetic, and a wrap marker can only be the lap's last entry.
            # (Plain arithmetic instead of min() and one modulo: the call is per batch,
            # often of one record, and each Python operation counts.)
            lap_pos = r % cap
            pos = self._data_off + lap_pos
            lap_end = pos + cap - lap_pos
            span = w - r
            if span > cap - lap_pos:
                span = cap - lap_pos
            if span > budget:
                span = budget  # records starting before pos + budget are read whole
            end = pos + span
            start = pos
            # Room goes back to the writer every _publish_bytes within a batch too, or
            # a writer waiting on a full ring would wait for the whole batch's copies.
            publish_at = start + self._published + self._publish_bytes - r
            while pos < end:
                n = q[pos >> 3]
                if n < 0:
                    pos = lap_end  # a wrap marker: the next record starts the next lap
                    break
                records.append(mm[pos + HEADER_BYTES : pos + HEADER_BYTES + n])
                pos += (n + 15) & -8
                if pos > publish_at:
                    if q[self._token_w] != self._token:  # the copies so far are intact
                        raise self._detached()
                    self._publish(r + pos - start)
                    publish_at = pos + self._publish_bytes
            r += pos - start
            budget -= pos - start
        # After every copy (see try_recv): an overwritten record implies a lost token.
        if q[self._token_w] != self._token:
            raise self._detached()
        self._r = r
        if r - self._published > self._publish_bytes:
            self._publish(r)
        return records

    def _publish(self, r: int) -> None:
        # NOTE: frees every record before r for the writer; stays after their copies.
        # Publishing every few records instead of every record (see __init__) saves a
        # store to a contended cache line and the writer-asleep check per record.
        self._q[self._cursor_w] = r
        self._published = r
        if self._q[WRITER_ASLEEP_W]:
            self._writer_bell.ring()

    def _detached(self) -> ReaderDetachedError:
        return ReaderDetachedError(f"reader {self.reader_index} of {self.name} was detached")

    def _is_readable(self) -> bool:
        q = self._q
        return q[WRITE_CURSOR_W] != self._r or q[CLOSED_W] != 0 or q[self._token_w] != self._token

    def _poll(self) -> bytes | None:
        # `closed` is loaded before the cursor: the writer stores it after its last
        # publication, so closed + nothing to read means the stream has ended.
        is_closed = self._q[CLOSED_W]
        data = self.try_recv()
        if data is None:
            self._check_live(is_closed)
        return data

    def _poll_many(self) -> list[bytes] | None:
        is_closed = self._q[CLOSED_W]  # before the cursor, as in _poll
        records = self.try_recv_many()
        if not records:
            self._check_live(is_closed)
            return None
        return records

    def _check_live(self, is_closed: int) -> None:
        if is_closed or self._closed:
            raise ChannelClosedError(f"ring {self.name} is closed and drained")
        if self._q[self._token_w] != self._token:
            raise self._detached()

    def recv(self, timeout_s: float | None = None) -> bytes:
        """Return the next record's payload, waiting up to `timeout_s` seconds (None: forever).

        Spins for SPIN_NS, then sleeps on the doorbell (no CPU while idle).
        Raises:
            TimeoutError: nothing arrived in time.
            ChannelClosedError: the writer closed the ring and everything was read.
            ReaderDetachedError: this reader was marked dead.
        """
        # NOTE: try_recv's fast path, inlined (keep the two identical): a Python call
        # costs ~100 ns, a sixth of a receive.
        r = self._r
        if r == self._cached_w:
            self._cached_w = self._q[WRITE_CURSOR_W]
        if r != self._cached_w:
            q = self._q
            base = self._data_off + r % self._cap
            n = q[base >> 3]
            if n >= 0:
                data = self._mm[base + HEADER_BYTES : base + HEADER_BYTES + n]
                if q[self._token_w] != self._token:
                    raise self._detached()
                r += (n + 15) & -8
                self._r = r
                if r - self._published > self._publish_bytes:
                    self._publish(r)
                return data
        return self._recv_waiting(timeout_s, self._poll)

    def recv_many(self, timeout_s: float | None = None) -> list[bytes]:
        """Every record published now, waiting up to `timeout_s` seconds for the first.

        Never returns an empty list. Errors as `recv`.
        """
        records = self.try_recv_many()
        if records:
            return records
        return self._recv_waiting(timeout_s, self._poll_many)

    def _recv_waiting(self, timeout_s: float | None, poll: Callable[[], T | None]) -> T:
        data = poll()
        if data is not None:
            return data
        spin_end_ns = time.perf_counter_ns() + SPIN_NS
        while time.perf_counter_ns() < spin_end_ns:
            data = poll()
            if data is not None:
                return data
            os.sched_yield()  # see SPIN_NS in doorbell.py
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            data = poll()
            if data is not None:
                return data
            wait_s = None
            if deadline is not None:
                wait_s = deadline - time.monotonic()
                if wait_s <= 0:
                    raise TimeoutError(f"ring {self.name}: no record within {timeout_s} s")
            self._bell.wait(self._is_readable, wait_s)

    async def recv_async(self) -> bytes:
        """Like `recv()` without a timeout, but never blocks the event loop.

        Polls cooperatively (yielding to the loop) for SPIN_NS, then waits in a helper
        thread. Cancelling it is clean: no record is consumed by a cancelled call. Use
        `asyncio.wait_for` / `anyio.fail_after` for a timeout.
        """
        data = self.try_recv()
        if data is not None:
            return data
        return await self._recv_waiting_async(self._poll)

    async def recv_many_async(self) -> list[bytes]:
        """`recv_many()` for asyncio: every record published now, awaiting the first
        without blocking the loop (as `recv_async`; cancelling consumes nothing)."""
        records = self.try_recv_many()
        if records:
            return records
        return await self._recv_waiting_async(self._poll_many)

    async def _recv_waiting_async(self, poll: Callable[[], T | None]) -> T:
        spin_end_ns = time.perf_counter_ns() + SPIN_NS
        while time.perf_counter_ns() < spin_end_ns:
            await asyncio.sleep(0)
            data = poll()
            if data is not None:
                return data
        while True:
            data = poll()
            if data is not None:
                return data
            if self._waiter is None:
                self._waiter = AsyncWaiter(self._bell, f"fe-wait{self.name}-r{self.reader_index}")
            await self._waiter.wait(self._is_readable)

    def close(self) -> None:
        """Detach from the slot (the writer stops waiting for it) and stop waiting. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._waiter is not None:
            self._waiter.close()
        if not self.segment.closed:
            self.segment.release_reader(self.reader_index, self._token)
        if self._own_segment:
            self.segment.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
