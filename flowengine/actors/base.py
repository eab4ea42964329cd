"""Actor plumbing: the channel interface every actor talks through.

In-process channels are `flowengine.shm.InprocChannel`; shared-memory ones are
`flowengine.shm.Channel` over a ring.

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

