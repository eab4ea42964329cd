"""Await a doorbell from asyncio without blocking the event loop.

Semaphores cannot be polled by an event loop, so a ring endpoint hands its sleep to a
helper thread and awaits a future the thread resolves. The thread only *waits*; the
record itself is read afterwards in the event loop's thread, so cancelling the await
can never lose a record.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable

from flowengine.shm.doorbell import Doorbell

_Request = tuple[Callable[[], bool], threading.Event, asyncio.AbstractEventLoop, asyncio.Future]


class AsyncWaiter:
    """One daemon thread per endpoint that runs `Doorbell.wait` for asyncio callers.

    A dedicated thread (not the loop's default executor) because every idle actor holds
    a waiter for as long as it idles; a shared pool would run out of workers. It is a
    daemon thread so a forgotten endpoint never blocks interpreter exit.
    """

    def __init__(self, bell: Doorbell, thread_name: str) -> None:
        self._bell = bell
        self._requests: queue.SimpleQueue[_Request | None] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._active: threading.Event | None = None
        self._thread = threading.Thread(target=self._serve, name=thread_name, daemon=True)
        self._thread.start()

    async def wait(self, is_ready: Callable[[], bool]) -> None:
        """Return once `is_ready()` held in the helper thread (callers re-check).

        Cancellation: the helper thread is told to stop and woken; CancelledError
        propagates at once.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        cancel = threading.Event()
        self._requests.put((is_ready, cancel, loop, future))
        try:
            await future
        except asyncio.CancelledError:
            cancel.set()
            self._bell.poke()
            raise

    def _serve(self) -> None:
        while True:
            request = self._requests.get()
            if request is None:
                return
            is_ready, cancel, loop, future = request
            error: BaseException | None = None
            # Publish the cancel event before checking _stop (close() does the reverse),
            # so a close racing this request always reaches it.
            self._active = cancel
            if not cancel.is_set() and not self._stop.is_set():
                try:
                    self._bell.wait(is_ready, None, cancel)
                except BaseException as exc:  # delivered to the awaiting task
                    error = exc
            self._active = None
            try:
                loop.call_soon_threadsafe(_resolve, future, error)
            except RuntimeError:
                pass  # the loop is closed: nobody awaits any more

    def close(self, timeout_s: float = 1.0) -> None:
        """Stop the thread: end a wait in progress and join (at most `timeout_s`)."""
        self._stop.set()
        active = self._active
        if active is not None:
            active.set()
        self._requests.put(None)
        self._bell.poke()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)


def _resolve(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
