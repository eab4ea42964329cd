"""The writing end of a ring (see record.py for the format and memory-ordering NOTE).

The per-record fast path (`try_send`, `send`) is the C base class `WriterCore`
(_ring.c); this module holds everything else: set-up, wrap markers, waiting, doorbells.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Self

from flowengine.shm._ring import WriterCore
from flowengine.shm.async_wait import AsyncWaiter
from flowengine.shm.doorbell import SPIN_NS, full_fence
from flowengine.shm.errors import ChannelClosedError, RecordTooLargeError
from flowengine.shm.record import HEADER_BYTES, WRAP, record_bytes
from flowengine.shm.segment import (
    CLOSED_W,
    DEAD,
    LIVE,
    R_START,
    R_STATE,
    READERS_ASLEEP_W,
    WRITE_CURSOR_W,
    WRITER_PID_W,
    RingSegment,
    is_process_alive,
    reader_ctl_word,
    reader_cursor_word,
)

# A writer blocked on a full ring looks for dead readers this often, in seconds.
STALL_CHECK_S = 0.1


class RingWriter(WriterCore):
    """The single writer of a point-to-point ring. One thread or task at a time.

    `try_send(data) -> bool` and `send(data, timeout_s=None)` come from WriterCore
    (their docstrings give the errors); they call `_try_send_slow` and `_send_waiting`
    here when a record crosses the end of the buffer or finds the ring full.

    Args:
        segment: the mapped segment; with `own_segment` close() also unmaps it.
    Raises:
        ValueError: the segment has several readers (use BroadcastWriter).
        RingError: another live process is this ring's writer.
    """

    def __init__(self, segment: RingSegment, *, own_segment: bool = False) -> None:
        if segment.num_readers != 1 and type(self) is RingWriter:
            raise ValueError(
                f"{segment.name} has {segment.num_readers} readers: use BroadcastWriter"
            )
        self.segment = segment
        self.name = segment.name
        self.capacity_bytes = segment.capacity_bytes
        self.max_payload_bytes = segment.capacity_bytes - HEADER_BYTES
        self.num_full_waits = 0  # sends that found the ring full (backpressure events)
        self._own_segment = own_segment
        self._q = segment.words
        self._cap = segment.capacity_bytes
        self._data_off = segment.data_offset
        self._bell = segment.writer_bell()
        self._reader_bells = tuple(segment.reader_bell(i) for i in range(segment.num_readers))
        self._w = segment.claim_writer()
        self._bind(segment.mm, WRITE_CURSOR_W, READERS_ASLEEP_W)
        # Cursor bookkeeping, so the hot path needs no modulo and one bound check:
        # _lap_end is the cursor at the end of the buffer for the current lap, _base
        # turns a cursor of this lap into a byte offset in the mapping, _limit is how
        # far the readers let us write (cached), _fast_end = min(_lap_end, _limit).
        self._lap_end = self._w - self._w % self._cap + self._cap
        self._base = self._data_off - (self._lap_end - self._cap)
        self._limit = 0
        self._fast_end = 0
        self._waiter: AsyncWaiter | None = None
        self._closed = False
        self._refresh_limit()

    @classmethod
    def attach(cls, name: str) -> Self:
        """Attach by segment name (e.g. in a spawned process); close() unmaps."""
        segment = RingSegment.attach(name)
        try:
            return cls(segment, own_segment=True)
        except BaseException:
            segment.close()
            raise

    def _try_send_slow(self, data: bytes | bytearray | memoryview, n: int) -> bool:
        # Called by WriterCore.try_send when the record (n payload bytes) crosses the
        # end of the lap or the cached room: settle both, then try the fast path again.
        if n > self.max_payload_bytes:
            raise RecordTooLargeError(
                f"record of {n} bytes exceeds the largest record ring {self.name} can hold "
                f"({self.max_payload_bytes} bytes: capacity {self._cap} - {HEADER_BYTES} "
                f"header); create the ring with a larger capacity_bytes"
            )
        if self._w == self._lap_end:
            self._next_lap()
        if self._w + record_bytes(n) > self._lap_end:
            # Skip the tail [w, lap end): it must be free before the marker goes in.
            if self._lap_end > self._limit:
                self._refresh_limit()
                if self._lap_end > self._limit:
                    return False
            q = self._q
            q[(self._w + self._base) >> 3] = WRAP
            q[WRITE_CURSOR_W] = self._lap_end
            self._w = self._lap_end
            self._next_lap()
            # A sleeping reader must skip the marker to free the tail for the writer.
            if q[READERS_ASLEEP_W]:
                self._wake_readers()
        if self._w + record_bytes(n) > self._limit:
            self._refresh_limit()
        if self._w + record_bytes(n) > self._fast_end:
            return False
        return self.try_send(data)

    def _next_lap(self) -> None:
        self._lap_end = self._w + self._cap
        self._base = self._data_off - self._w
        self._fast_end = min(self._lap_end, self._limit)

    def _wake_readers(self) -> None:
        self._q[READERS_ASLEEP_W] = 0
        for bell in self._reader_bells:
            bell.ring()

    def _refresh_limit(self) -> None:
        # The fence orders our last cursor store before the loads of reader state
        # (RingSegment.claim_reader relies on it); slow path, about once per lap.
        full_fence()
        q = self._q
        if q[reader_ctl_word(0) + R_STATE] == DEAD:
            self._limit = self._w + self._cap  # nobody to wait for
        else:
            self._limit = q[reader_cursor_word(0)] + self._cap
        self._fast_end = min(self._lap_end, self._limit)

    def _has_room_for(self, n: int) -> bool:
        w, total = self._w, record_bytes(n)
        lap_end = self._lap_end if w < self._lap_end else w + self._cap
        end = w + total if w + total <= lap_end else lap_end + total
        self._refresh_limit()
        return end <= self._limit

    def _send_waiting(self, data: bytes | bytearray | memoryview, timeout_s: float | None) -> None:
        # Called by WriterCore.send when the ring is full: spin, then sleep (see send).
        self.num_full_waits += 1
        n = memoryview(data).nbytes  # bytes, as WriterCore counts them (not items)
        spin_end_ns = time.perf_counter_ns() + SPIN_NS
        while time.perf_counter_ns() < spin_end_ns:
            if self.try_send(data):
                return
            os.sched_yield()  # see SPIN_NS in doorbell.py
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.try_send(data):
            wait_s = STALL_CHECK_S
            if deadline is not None:
                wait_s = min(wait_s, deadline - time.monotonic())
                if wait_s <= 0:
                    raise TimeoutError(
                        f"ring {self.name}: no room for a {n}-byte record within {timeout_s} s; "
                        f"a reader is not keeping up"
                    )
            if not self._bell.wait(lambda: self._has_room_for(n), wait_s):
                self.reap_dead_readers()

    async def send_async(self, data: bytes | bytearray | memoryview) -> None:
        """Like `send` without a timeout, but never blocks the event loop; cancellable.

        Raises RecordTooLargeError, or ChannelClosedError if this writer is closed
        while waiting.
        """
        if self.try_send(data):
            return
        self.num_full_waits += 1
        n = memoryview(data).nbytes  # bytes, as WriterCore counts them (not items)
        spin_end_ns = time.perf_counter_ns() + SPIN_NS
        while time.perf_counter_ns() < spin_end_ns:
            await asyncio.sleep(0)  # a cooperative spin: other tasks run meanwhile
            if self.try_send(data):
                return
        while not self.try_send(data):
            if self._closed:
                raise ChannelClosedError(f"ring {self.name}: writer closed")
            if self._waiter is None:
                self._waiter = AsyncWaiter(self._bell, f"fe-wait{self.name}-w")
            try:
                await asyncio.wait_for(
                    self._waiter.wait(lambda: self._has_room_for(n)), STALL_CHECK_S
                )
            except TimeoutError:
                self.reap_dead_readers()

    def reap_dead_readers(self) -> list[int]:
        """Mark LIVE readers whose process is gone as dead so they stop holding room.

        Returns the reader indices reaped. Called automatically while a send waits.
        """
        reaped = []
        for i in range(self.segment.num_readers):
            ctl = reader_ctl_word(i)
            if self._q[ctl + R_STATE] == LIVE:
                pid = self.segment.reader_pid(i)
                # A first look without the lock (cheap, every STALL_CHECK_S); the slot
                # lock then re-checks, so a successor claiming the slot is not reaped.
                if pid and not is_process_alive(pid, self._q[ctl + R_START]):
                    if self.segment.reap_reader_if_dead(i):
                        reaped.append(i)
        return reaped

    def mark_reader_dead(self, i: int) -> None:
        """Stop waiting for reader `i` (hung or crashed); see RingSegment.mark_reader_dead."""
        self.segment.mark_reader_dead(i)

    def close(self) -> None:
        """Mark the ring closed (readers drain it, then get ChannelClosedError). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._waiter is not None:
            self._waiter.close()
        if not self.segment.closed:
            # After every publication: readers load `closed` before the cursor.
            self._q[CLOSED_W] = 1
            self._wake_readers()
            self._q[WRITER_PID_W] = 0
        self._unbind()  # later sends raise ChannelClosedError; the mapping may be closed
        if self._own_segment:
            self.segment.close()

    def detach(self) -> None:
        """Stop writing without closing the ring: free the writer slot and stop the
        waiter thread, leaving `closed` unset so that readers keep waiting for the
        next writer (the Ray relay of a rank that a restart replaces). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._waiter is not None:
            self._waiter.close()
        if not self.segment.closed and self._q[WRITER_PID_W] == os.getpid():
            self._q[WRITER_PID_W] = 0
        self._unbind()
        if self._own_segment:
            self.segment.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
