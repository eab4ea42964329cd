"""Actor plumbing: the channel interface every actor talks through.

An actor is a class with inboxes, a `run()` coroutine and pure logic it delegates to
(DESIGN.md §1). Channels have one interface whether they are in-process queues or
shared-memory rings (`flowengine.shm`), so placement is configuration.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import anyio
import anyio.to_thread

T = TypeVar("T")


class Channel(Protocol):
    """One direction of messages between two actors (or one writer, N readers)."""

    async def send_async(self, msg: Any) -> None: ...

    async def recv_async(self) -> Any: ...

    def try_recv(self) -> Any | None: ...

    def close(self) -> None: ...


async def run_blocking(fn: Callable[..., T], *args: Any) -> T:
    """Run blocking work (a model forward) off the event loop, in a worker thread.

    torch releases the GIL inside its kernels, so the loop's other actors keep running.
    """
    return await anyio.to_thread.run_sync(fn, *args, abandon_on_cancel=False)


class InprocChannel:
    """A channel between actors of one process (one event loop), unbounded.

    Same interface as the shared-memory channels, so actors do not know their placement.
    Messages pass by reference: no encoding, no copy.
    """

    def __init__(self, max_buffer_size: float = float("inf")) -> None:
        self._send, self._recv = anyio.create_memory_object_stream[Any](max_buffer_size)

    async def send_async(self, msg: Any) -> None:
        await self._send.send(msg)

    def send(self, msg: Any) -> None:
        self._send.send_nowait(msg)

    async def recv_async(self) -> Any:
        return await self._recv.receive()

    def try_recv(self) -> Any | None:
        try:
            return self._recv.receive_nowait()
        except anyio.WouldBlock:
            return None

    def close(self) -> None:
        self._send.close()
        self._recv.close()
