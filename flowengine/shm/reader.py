"""The reading end of a ring (see record.py for the format and memory-ordering NOTE).

The same class reads a point-to-point ring (reader_index 0) and one slot of a
broadcast ring. The per-record fast paths (`try_recv`, `recv`, `try_recv_many`,
`recv_many`) are the C base class `ReaderCore` (_ring.c); this module holds set-up,
waiting and doorbells.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Self, TypeVar

from flowengine.shm._ring import ReaderCore
from flowengine.shm.async_wait import AsyncWaiter
from flowengine.shm.doorbell import SPIN_NS
from flowengine.shm.errors import ChannelClosedError, ReaderDetachedError
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


class RingReader(ReaderCore):
    """Reader `reader_index` of a ring. One thread or task at a time.

    `try_recv`, `recv(timeout_s=None)`, `try_recv_many` and `recv_many(timeout_s=None)`
    come from ReaderCore (their docstrings give the errors); they call `_wake_writer`,
    `_detached` and `_recv_waiting` here.

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
        self._q = segment.words
        self._cursor_w = reader_cursor_word(reader_index)
        self._token_w = reader_ctl_word(reader_index) + R_TOKEN
        self._r, self._token = segment.claim_reader(reader_index)
        self._bind(
            segment.mm,
            WRITE_CURSOR_W,
            self._token_w,
            self._cursor_w,
            WRITER_ASLEEP_W,
            segment.data_offset,
            segment.capacity_bytes,
            MAX_BATCH_BYTES,
        )
        self._bell = segment.reader_bell(reader_index)
        self._writer_bell = segment.writer_bell()
        self._cached_w = self._r  # last write cursor seen; reloaded only when caught up
        # The read cursor is published (stored for the writer) only every
        # _publish_bytes of records and whenever the reader catches up, so the writer
        # may see up to an eighth of the ring as still in use.
        self._published = self._r
        self._publish_bytes = segment.capacity_bytes // 8
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

    def _wake_writer(self) -> None:
        # Called by ReaderCore after it published its cursor and saw the writer asleep.
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
        self._unbind()  # later receives raise ChannelClosedError; the mapping may be closed
        if self._own_segment:
            self.segment.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
