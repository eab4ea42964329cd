"""In-process channel with the same interface as the shared-memory `Channel`.

Lets every actor run in one process (tests, CPU debugging, offline `LLM`) unchanged.
Safe to use from several threads and from asyncio tasks on any event loop.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from typing import Any, Generic, TypeVar

import msgspec

from flowengine.shm.errors import ChannelClosedError

T = TypeVar("T")


class InprocChannel(Generic[T]):
    """A FIFO of messages between actors of one process.

    Args:
        msg_type: message type; required with `roundtrip`.
        maxsize: most messages held before senders wait (0: unbounded).
        roundtrip: encode on send and decode on receive with msgspec, exactly like a
            shared-memory Channel, so in-process runs catch schema errors and never
            share a mutable message between actors. Off: messages pass by reference
            and a sender must not mutate a message after sending it.
    """

    def __init__(
        self, msg_type: type[T] | Any = None, *, maxsize: int = 0, roundtrip: bool = False
    ) -> None:
        if roundtrip and msg_type is None:
            raise ValueError("roundtrip=True needs msg_type to decode with")
        if maxsize < 0:
            raise ValueError(f"maxsize {maxsize} must be >= 0 (0 means unbounded)")
        self.msg_type = msg_type
        self.maxsize = maxsize
        self._encoder = msgspec.msgpack.Encoder() if roundtrip else None
        self._decoder = msgspec.msgpack.Decoder(msg_type) if roundtrip else None
        self._items: deque[Any] = deque()
        self._lock = threading.Lock()
        self._not_empty = threading.Condition(self._lock)
        self._not_full = threading.Condition(self._lock)
        self._recv_waiters: list[asyncio.Future[None]] = []
        self._send_waiters: list[asyncio.Future[None]] = []
        self._closed = False

    def __len__(self) -> int:
        return len(self._items)

    def try_send(self, msg: T) -> bool:
        """Queue `msg` if there is room; False if full. Raises ChannelClosedError after close."""
        item = msg if self._encoder is None else self._encoder.encode(msg)
        with self._lock:
            if self._closed:
                raise ChannelClosedError("in-process channel is closed")
            if self.maxsize and len(self._items) >= self.maxsize:
                return False
            self._items.append(item)
            self._not_empty.notify()
            _wake_all(self._recv_waiters)
        return True

    def send(self, msg: T, timeout_s: float | None = None) -> None:
        """Queue `msg`, waiting while full. Raises TimeoutError, ChannelClosedError.

        Do not call it from an event loop on a bounded channel (it would block the
        loop); use send_async there.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.try_send(msg):
            with self._lock:
                while self.maxsize and len(self._items) >= self.maxsize and not self._closed:
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise TimeoutError(f"in-process channel full for {timeout_s} s")
                    self._not_full.wait(remaining)

    async def send_async(self, msg: T) -> None:
        """Queue `msg`, awaiting room without blocking the loop; cancellable."""
        while not self.try_send(msg):
            await self._await(self._send_waiters, lambda: len(self._items) < self.maxsize)

    def try_recv(self) -> T | None:
        """The next message, or None if empty (also when closed: recv raises then)."""
        with self._lock:
            if not self._items:
                return None
            item = self._items.popleft()
            self._not_full.notify()
            _wake_all(self._send_waiters)
        return item if self._decoder is None else self._decoder.decode(item)

    def recv(self, timeout_s: float | None = None) -> T:
        """The next message, waiting up to `timeout_s` seconds (None: forever).

        Raises TimeoutError, or ChannelClosedError once closed and drained.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            msg = self.try_recv()
            if msg is not None:
                return msg
            with self._lock:
                while not self._items:
                    if self._closed:
                        raise ChannelClosedError("in-process channel is closed and drained")
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise TimeoutError(f"no message within {timeout_s} s")
                    self._not_empty.wait(remaining)

    async def recv_async(self) -> T:
        """The next message, awaited without blocking the loop; cancellable (loses nothing)."""
        while True:
            msg = self.try_recv()
            if msg is not None:
                return msg
            await self._await(self._recv_waiters, lambda: bool(self._items))

    async def _await(self, waiters: list[asyncio.Future[None]], is_ready: Any) -> None:
        future = asyncio.get_running_loop().create_future()
        with self._lock:
            if is_ready():
                return
            if self._closed:
                raise ChannelClosedError("in-process channel is closed and drained")
            waiters.append(future)
        try:
            await future
        finally:
            with self._lock:
                if future in waiters:
                    waiters.remove(future)

    def close(self) -> None:
        """Refuse further sends; receivers drain what is queued, then get ChannelClosedError."""
        with self._lock:
            self._closed = True
            self._not_empty.notify_all()
            self._not_full.notify_all()
            _wake_all(self._recv_waiters)
            _wake_all(self._send_waiters)


def _wake_all(waiters: list[asyncio.Future[None]]) -> None:
    # Wake every waiter (they re-check): with one consumer per channel this is one wakeup,
    # and a waiter cancelled after being woken cannot swallow the wakeup of another.
    try:
        current: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        current = None
    for future in waiters:
        loop = future.get_loop()
        if loop is current:
            _set(future)
        elif not loop.is_closed():
            loop.call_soon_threadsafe(_set, future)
    waiters.clear()


def _set(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
