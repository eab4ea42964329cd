"""Doorbell: how a ring endpoint sleeps without burning CPU and is woken by its peer.

A doorbell is a named POSIX semaphore plus an "asleep" word in the ring header. The
sleeper raises the word before it blocks on the semaphore; the peer, after publishing
(a record, or room), looks at the word and posts the semaphore only if it is raised.
So a busy ring costs the peer one shared-memory load per operation and no system call.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import posix_ipc

from flowengine.shm import _ring

# NOTE: lost wakeups. The sleeper raises its asleep word, fences, and re-checks the
# ring; the peer publishes (a record or room: WriterCore.send, ReaderCore's publish,
# both in _ring.c), fences, and checks the word (Dekker's pattern): one of the two
# always sees the other, so a wakeup is never lost between live processes. The first
# sleep after raising the word is still short, so a record published by a peer that was
# killed before it could post the semaphore is seen within FIRST_SLICE_S. While the
# word stays raised, later peers see it, so later slices can be long.
FIRST_SLICE_S = 0.001
# An idle endpoint wakes this often to re-check its predicate (and the writer to look
# for dead readers): 10 wakeups/s is far below 1% of a core.
LONG_SLICE_S = 0.1

# Poll this long before sleeping on a doorbell: longer than the gap between records of
# a busy stream, shorter than the tens of microseconds a semaphore wakeup costs. Blocking
# spins call os.sched_yield() between polls: with more runnable processes than cores
# (the engine's processes on a 2-core machine) a pure spin burns the time slice the peer
# needs to make progress, and yielding halved p50 latency there; on an idle core it
# returns at once (~0.5 us), which also spaces out our loads of the peer's cache line.
SPIN_NS = 50_000

full_fence = _ring.full_fence  # a sequentially consistent fence (x86-64: mfence), from C


class Doorbell:
    """One sleeper's doorbell: a POSIX semaphore and its asleep word in shared memory.

    Args:
        sem_name: name of an existing semaphore (created by `create`).
        words: the ring header as an int64 memoryview.
        flag_index: index in `words` of this sleeper's asleep word (0 = awake).
        summary_index: index of a word shared by several sleepers (the readers of a
            broadcast ring), raised with the flag, so the peer checks one word per
            operation instead of one per sleeper; the peer lowers it when it rings.
    """

    def __init__(
        self, sem_name: str, words: memoryview, flag_index: int, summary_index: int | None
    ) -> None:
        self.sem_name = sem_name
        self._sem = posix_ipc.Semaphore(sem_name)
        self._words = words
        self.flag_index = flag_index
        self.summary_index = summary_index

    @staticmethod
    def create(sem_name: str) -> None:
        """Create the semaphore with mode 0600, value 0; raises `posix_ipc.ExistentialError`."""
        posix_ipc.Semaphore(sem_name, posix_ipc.O_CREX, mode=0o600, initial_value=0).close()

    @staticmethod
    def unlink(sem_name: str) -> bool:
        """Remove the semaphore's name; return False if it did not exist (not an error)."""
        try:
            posix_ipc.unlink_semaphore(sem_name)
        except posix_ipc.ExistentialError:
            return False
        return True

    def ring(self) -> None:
        """Wake the sleeper if its asleep word is raised (called by the peer)."""
        if self._words[self.flag_index]:
            # Lowering the word first means a stream of records posts once per sleep,
            # not once per record; a stale post only causes one spurious wakeup.
            self._words[self.flag_index] = 0
            self._sem.release()

    def poke(self) -> None:
        """Post unconditionally: wakes a waiter of this process so it sees its cancel event."""
        self._sem.release()

    def wait(
        self,
        is_ready: Callable[[], bool],
        timeout_s: float | None,
        cancel: threading.Event | None = None,
    ) -> bool:
        """Sleep until `is_ready()` is true; return False on timeout or cancellation.

        `is_ready` must only read shared state (it runs again after every wakeup, and
        maybe in a helper thread). The caller spins before calling this; here we sleep.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._drain_stale_posts()
        slice_s = FIRST_SLICE_S
        try:
            while True:
                if self._words[self.flag_index] == 0:
                    # First pass, or the peer lowered the word when it rang: raise it,
                    # fence so the raise is visible before we read the cursor, re-check.
                    self._words[self.flag_index] = 1
                    if self.summary_index is not None:
                        self._words[self.summary_index] = 1
                    full_fence()
                    slice_s = FIRST_SLICE_S
                if is_ready():
                    return True
                if cancel is not None and cancel.is_set():
                    return False
                wait_s = slice_s
                if deadline is not None:
                    remaining_s = deadline - time.monotonic()
                    if remaining_s <= 0:
                        return False
                    wait_s = min(wait_s, remaining_s)
                try:
                    self._sem.acquire(wait_s)
                except posix_ipc.BusyError:
                    pass
                slice_s = LONG_SLICE_S
        finally:
            self._words[self.flag_index] = 0

    def _drain_stale_posts(self) -> None:
        # Posts left over from earlier sleeps (a ring racing a timeout, a poke) would
        # only cause spurious wakeups; draining them keeps the sleep quiet.
        while True:
            try:
                self._sem.acquire(0)
            except posix_ipc.BusyError:
                return

    def close(self) -> None:
        """Close this process's handle (the name stays until `unlink`)."""
        self._sem.close()
