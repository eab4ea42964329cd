"""The shared-memory segment under a ring: naming, header layout, lifetime, cleanup.

Layout (each line is one 64-byte cache line of eight int64 words). Words written on
every record (the cursors) sit alone on their line; words read on every record but
written rarely (asleep flags, closed, reader state) sit on other lines, so the hot
path never false-shares:

    line 0         magic, version, capacity_bytes, num_readers, creator pid,
                   creator start time, data offset
    line 1         write cursor
    line 2         writer asleep, any reader asleep, closed, writer pid, writer start
    line 3 + 2i    reader i's read cursor
    line 4 + 2i    reader i's control: asleep, pid, state, start time, attach token,
                   slot lock
    data           capacity_bytes of records

Cursors are byte counts since creation (monotonic int64, never wrap in practice:
2**63 bytes); a record lives at `cursor % capacity_bytes`. A process is identified by
pid *and* start time (from /proc) so that a recycled pid is not mistaken for the
original process.

Names: segment `/fe-<run_id>-<ring_name>`, semaphores `<segment>-w` (writer doorbell)
and `<segment>-r<i>` (reader i). On Linux they appear in /dev/shm as `fe-...` and
`sem.fe-...`. Everything is created with mode 0600: only our user may attach.
"""

from __future__ import annotations

import atexit
import errno
import mmap
import os
import re
import secrets
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import posix_ipc

from flowengine.shm._ring import cas64
from flowengine.shm.doorbell import Doorbell, full_fence
from flowengine.shm.errors import RingError

MAGIC = int.from_bytes(b"FEngRing", "little")
VERSION = 1
CACHE_LINE_BYTES = 64
_WORDS_PER_LINE = CACHE_LINE_BYTES // 8
MAX_READERS = 64
DEFAULT_CAPACITY_BYTES = 4 << 20
SHM_DIR = "/dev/shm"

# Word indices of lines 0-2.
MAGIC_W, VERSION_W, CAPACITY_W, NUM_READERS_W, CREATOR_PID_W, CREATOR_START_W, DATA_OFF_W = range(7)
WRITE_CURSOR_W = 8
WRITER_ASLEEP_W, READERS_ASLEEP_W, CLOSED_W, WRITER_PID_W, WRITER_START_W = range(16, 21)
# Offsets inside a reader's control line.
R_ASLEEP, R_PID, R_STATE, R_START, R_TOKEN, R_LOCK = range(6)

# Reader slot states. RESERVED slots (never attached yet) are waited for like LIVE
# ones, so records sent before a reader process starts are not lost.
RESERVED, LIVE, DEAD = 0, 1, 2

_NAME_RE = re.compile(r"^[A-Za-z0-9_]{1,64}$")


def new_run_id() -> str:
    """A random run id (8 hex chars) that namespaces every segment of one engine run."""
    return secrets.token_hex(4)


def segment_name(run_id: str, ring_name: str) -> str:
    """The POSIX name `/fe-<run_id>-<ring_name>`; raises ValueError on bad characters."""
    for what, value in (("run_id", run_id), ("ring_name", ring_name)):
        if not _NAME_RE.match(value):
            raise ValueError(f"{what} {value!r} must be 1-64 characters of [A-Za-z0-9_]")
    return f"/fe-{run_id}-{ring_name}"


def reader_cursor_word(i: int) -> int:
    """Index in the int64 header of reader `i`'s read cursor."""
    return (3 + 2 * i) * _WORDS_PER_LINE


def reader_ctl_word(i: int) -> int:
    """Index in the int64 header of the first word of reader `i`'s control line."""
    return (4 + 2 * i) * _WORDS_PER_LINE


def _proc_stat(pid: int) -> tuple[bytes, int] | None:
    """(state letter, start time in clock ticks since boot) of `pid`, or None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after it.
    fields = stat[stat.rindex(b")") + 2 :].split()
    return fields[0], int(fields[19])  # fields 3 and 22 of proc(5)


def _is_gone(pid: int) -> bool:
    """True if `pid` runs no more (or is a zombie)."""
    stat = _proc_stat(pid)
    return stat is None or stat[0] in (b"Z", b"X")


# Serialises this process's threads on the slot locks (RingSegment._slot_locked).
_THREAD_LOCK = threading.Lock()


def process_start_ticks(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot (/proc/<pid>/stat field 22), or None."""
    stat = _proc_stat(pid)
    return None if stat is None else stat[1]


def is_process_alive(pid: int, start_ticks: int) -> bool:
    """True if `pid` runs and is the process that recorded `start_ticks`.

    A zombie (killed, not yet waited for by its parent) counts as dead: it will never
    read or write a ring again.
    """
    stat = _proc_stat(pid) if pid > 0 else None
    return stat is not None and stat[0] not in (b"Z", b"X") and stat[1] == start_ticks


def _allocate(fd: int, size_bytes: int, name: str) -> None:
    """Back every page of a new segment now. Raises OSError (ENOSPC) naming the fix.

    NOTE: tmpfs grants a sparse segment larger than its free space, and the first write
    to a page it cannot back is a SIGBUS that kills the process without a word; Docker's
    default /dev/shm (64 MiB) is smaller than the engine's rings."""
    try:
        os.posix_fallocate(fd, 0, size_bytes)
    except OSError as err:
        if err.errno != errno.ENOSPC:
            return  # a file system without fallocate: nothing to check in advance
        free = os.statvfs(SHM_DIR)
        raise OSError(errno.ENOSPC, (
            f"{SHM_DIR} has no room for the {size_bytes / 2**20:.0f} MiB shared-memory "
            f"ring {name} ({free.f_bavail * free.f_frsize / 2**20:.0f} MiB free); give it "
            "more (Docker: docker run --shm-size=1g, or --ipc=host)")) from None


class RingSegment:
    """A mapped ring segment: the header words, the data area and the doorbells.

    Build with `create` (the owner, normally the supervisor) or `attach` (any process
    of the same user, by name). The owner unlinks the segment and its semaphores on
    `close()` and at interpreter exit.

    Attributes:
        name: POSIX name, e.g. "/fe-1a2b3c4d-steps".
        capacity_bytes: size of the data area in bytes (multiple of 8).
        num_readers: reader slots (1 for a point-to-point ring).
        data_offset: byte offset of the data area in the mapping.
        mm: the mapping; words: it as int64 memoryview (header access).
    """

    def __init__(self, name: str, mm: mmap.mmap, is_owner: bool) -> None:
        self.name = name
        self.mm = mm
        self.words = memoryview(mm).cast("q")
        self.is_owner = is_owner
        if self.words[MAGIC_W] != MAGIC or self.words[VERSION_W] != VERSION:
            self.words.release()
            mm.close()
            raise RingError(f"{name} is not a FlowEngine ring of version {VERSION}")
        self.capacity_bytes = self.words[CAPACITY_W]
        self.num_readers = self.words[NUM_READERS_W]
        self.data_offset = self.words[DATA_OFF_W]
        self._bells: dict[str, Doorbell] = {}
        self._closed = False
        if is_owner:
            atexit.register(self.close)

    @classmethod
    def create(
        cls,
        ring_name: str,
        *,
        capacity_bytes: int = DEFAULT_CAPACITY_BYTES,
        num_readers: int = 1,
        run_id: str | None = None,
    ) -> RingSegment:
        """Create a segment and its semaphores (mode 0600); this process becomes the owner.

        Raises:
            ValueError: capacity_bytes not a multiple of 8 or below 64; num_readers
                outside 1..64; bad names.
            RingError: a segment of that name exists (run id reused).
            OSError: /dev/shm has no room for the segment (ENOSPC; the message says how
                to give a container more).
        """
        if capacity_bytes < 64 or capacity_bytes % 8:
            raise ValueError(f"capacity_bytes {capacity_bytes} must be a multiple of 8, >= 64")
        if not 1 <= num_readers <= MAX_READERS:
            raise ValueError(f"num_readers {num_readers} must be in 1..{MAX_READERS}")
        name = segment_name(run_id or new_run_id(), ring_name)
        data_offset = (3 + 2 * num_readers) * CACHE_LINE_BYTES
        try:
            shm = posix_ipc.SharedMemory(
                name, posix_ipc.O_CREX, mode=0o600, size=data_offset + capacity_bytes
            )
        except posix_ipc.ExistentialError:
            raise RingError(f"shared memory {name} already exists; use a new run id") from None
        try:
            _allocate(shm.fd, shm.size, name)
            mm = mmap.mmap(shm.fd, shm.size)
            shm.close_fd()
            for sem_name in _semaphore_names(name, num_readers):
                Doorbell.create(sem_name)
            words = memoryview(mm).cast("q")
            words[VERSION_W] = VERSION
            words[CAPACITY_W] = capacity_bytes
            words[NUM_READERS_W] = num_readers
            words[CREATOR_PID_W] = os.getpid()
            words[CREATOR_START_W] = process_start_ticks(os.getpid()) or 0
            words[DATA_OFF_W] = data_offset
            # Magic last: a segment with a magic has a complete header.
            words[MAGIC_W] = MAGIC
            words.release()
        except BaseException:
            _unlink_all(name, num_readers)
            raise
        return cls(name, mm, is_owner=True)

    @classmethod
    def attach(cls, name: str) -> RingSegment:
        """Map an existing segment by name; raises RingError if it is missing or not a ring."""
        try:
            shm = posix_ipc.SharedMemory(name)
        except posix_ipc.ExistentialError:
            raise RingError(f"no shared memory segment {name}") from None
        try:
            mm = mmap.mmap(shm.fd, shm.size)
        finally:
            shm.close_fd()
        return cls(name, mm, is_owner=False)

    @property
    def closed(self) -> bool:
        """True once close() ran in this process (the mapping is gone)."""
        return self._closed

    def writer_bell(self) -> Doorbell:
        """The writer's doorbell (rung by readers when they free room)."""
        return self._bell(f"{self.name}-w", WRITER_ASLEEP_W, None)

    def reader_bell(self, i: int) -> Doorbell:
        """Reader `i`'s doorbell (rung by the writer when it publishes)."""
        return self._bell(f"{self.name}-r{i}", reader_ctl_word(i) + R_ASLEEP, READERS_ASLEEP_W)

    def _bell(self, sem_name: str, flag_index: int, summary_index: int | None) -> Doorbell:
        bell = self._bells.get(sem_name)
        if bell is None:
            bell = Doorbell(sem_name, self.words, flag_index, summary_index)
            self._bells[sem_name] = bell
        return bell

    def reader_state(self, i: int) -> int:
        """RESERVED, LIVE or DEAD."""
        return self.words[reader_ctl_word(i) + R_STATE]

    def reader_pid(self, i: int) -> int:
        """Pid of the process attached to reader slot `i` (0 if none)."""
        return self.words[reader_ctl_word(i) + R_PID]

    def claim_writer(self) -> int:
        """Record this process as the writer; return the write cursor to resume from.

        Raises RingError if a live process (this one included) holds the writer slot;
        a writer that closed frees it.
        """
        w = self.words
        pid, start = w[WRITER_PID_W], w[WRITER_START_W]
        if pid and is_process_alive(pid, start):
            raise RingError(f"{self.name} already has a live writer (pid {pid})")
        w[WRITER_PID_W] = os.getpid()
        w[WRITER_START_W] = process_start_ticks(os.getpid()) or 0
        w[CLOSED_W] = 0
        return w[WRITE_CURSOR_W]

    @contextmanager
    def _slot_locked(self, i: int) -> Iterator[None]:
        """Hold reader slot `i`'s lock: its pid, state, start time and token change
        together, never interleaved with another process's change (claim vs reap).

        NOTE: the lock word holds the holder's pid (taken by compare-and-swap from 0).
        A holder that died holding it (kill -9 mid-claim) is recognised and the lock
        taken over; a live holder keeps it for a few stores only, so waiting spins.
        """
        word = reader_ctl_word(i) + R_LOCK
        me = os.getpid()
        # Threads of this process take turns on _THREAD_LOCK first, so a lock word that
        # holds our own pid can only be left by a dead process whose pid we reuse.
        with _THREAD_LOCK:
            while not cas64(self.mm, word, 0, me):
                holder = self.words[word]
                if holder and (holder == me or _is_gone(holder)):
                    cas64(self.mm, word, holder, 0)  # its holder is gone: free it
                    continue
                os.sched_yield()
            try:
                yield
            finally:
                cas64(self.mm, word, me, 0)

    def claim_reader(self, i: int) -> tuple[int, int]:
        """Record this process as reader `i`; return (read cursor to start from, token).

        A slot never attached (RESERVED) starts at its cursor, so nothing sent before
        is lost. A slot whose reader died or was detached restarts at the current write
        cursor. The token identifies this attachment for `release_reader`. Raises
        RingError if the slot is held by a live process (this one included).
        """
        if not 0 <= i < self.num_readers:
            raise ValueError(f"reader_index {i} outside 0..{self.num_readers - 1} of {self.name}")
        with self._slot_locked(i):
            return self._claim_reader_locked(i)

    def _claim_reader_locked(self, i: int) -> tuple[int, int]:
        w, ctl, cur = self.words, reader_ctl_word(i), reader_cursor_word(i)
        pid, state = w[ctl + R_PID], w[ctl + R_STATE]
        if state == LIVE and pid and is_process_alive(pid, w[ctl + R_START]):
            raise RingError(f"reader slot {i} of {self.name} is held by live pid {pid}")
        token = secrets.randbits(62) + 1
        w[ctl + R_TOKEN] = token
        w[ctl + R_PID] = os.getpid()
        w[ctl + R_START] = process_start_ticks(os.getpid()) or 0
        if state == RESERVED:
            w[ctl + R_STATE] = LIVE
            return w[cur], token
        # NOTE: re-attach protocol. The writer ignores a DEAD slot, so it may have
        # computed its room from a cursor newer than the one we read first. Publish a
        # cursor, become LIVE, fence, then re-read the write cursor: every room the
        # writer computed without seeing us LIVE is <= that second value + capacity
        # (the writer fences before it reads reader states).
        w[cur] = w[WRITE_CURSOR_W]
        w[ctl + R_STATE] = LIVE
        full_fence()
        cursor = w[WRITE_CURSOR_W]
        w[cur] = cursor
        self.writer_bell().ring()
        return cursor, token

    def reset_reader(self, i: int) -> None:
        """Make slot `i` RESERVED again at the current write cursor, as if never attached.

        The restart handshake (DESIGN.md §8): the supervisor calls it after every
        process that read or wrote this ring has exited and before their successors
        start. Records written from then on are kept until the next reader attaches,
        however late it does, so a one-shot message (ExecutorReady) cannot be missed.

        NOTE: only safe while no process is attached to the slot or writing the ring
        (nobody else touches the control line meanwhile). Raises RingError if a live
        process still holds the slot.
        """
        if not 0 <= i < self.num_readers:
            raise ValueError(f"reader_index {i} outside 0..{self.num_readers - 1} of {self.name}")
        w, ctl = self.words, reader_ctl_word(i)
        with self._slot_locked(i):
            pid = w[ctl + R_PID]
            if w[ctl + R_STATE] == LIVE and pid and is_process_alive(pid, w[ctl + R_START]):
                raise RingError(f"reader slot {i} of {self.name} is held by live pid {pid}")
            w[ctl + R_TOKEN] = 0  # an old attachment that still runs must not read on
            w[ctl + R_PID] = 0
            w[ctl + R_START] = 0
            w[ctl + R_ASLEEP] = 0
            w[reader_cursor_word(i)] = w[WRITE_CURSOR_W]
            w[ctl + R_STATE] = RESERVED

    def release_reader(self, i: int, token: int) -> None:
        """Detach reader `i` if it is still the attachment `token` (not a successor)."""
        with self._slot_locked(i):
            if self.words[reader_ctl_word(i) + R_TOKEN] == token:
                self._mark_reader_dead_locked(i)

    def mark_reader_dead(self, i: int) -> None:
        """Stop waiting for reader `i` (crashed or hung); wakes a writer blocked on it.

        Callable from any attached process (the writer, the supervisor). The reader, if
        it still runs, raises ReaderDetachedError at its next record.
        """
        with self._slot_locked(i):
            self._mark_reader_dead_locked(i)

    def reap_reader_if_dead(self, i: int) -> bool:
        """Mark reader `i` dead if it is LIVE and its process is gone; True if it was.

        The check and the change happen under the slot lock, so a successor that
        claims the slot meanwhile is never marked dead in its predecessor's place (nor
        left LIVE with its token cleared).
        """
        w, ctl = self.words, reader_ctl_word(i)
        with self._slot_locked(i):
            pid = w[ctl + R_PID]
            if w[ctl + R_STATE] != LIVE or not pid or is_process_alive(pid, w[ctl + R_START]):
                return False
            self._mark_reader_dead_locked(i)
            return True

    def _mark_reader_dead_locked(self, i: int) -> None:
        ctl = reader_ctl_word(i)
        # NOTE: token before state. A writer that sees DEAD may overwrite the reader's
        # records at once; the reader checks its token after each copy, and TSO makes
        # the token store visible before the state store the writer acted on.
        self.words[ctl + R_TOKEN] = 0
        self.words[ctl + R_STATE] = DEAD
        self.words[ctl + R_PID] = 0
        self.writer_bell().ring()

    def close(self) -> None:
        """Unmap; the owner also unlinks the segment and semaphores. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for bell in self._bells.values():
            bell.close()
        self._bells.clear()
        if self.is_owner:
            atexit.unregister(self.close)
            self.unlink()
        self.words.release()
        try:
            self.mm.close()
        except BufferError:
            # A view into the mapping is still referenced (e.g. by a traceback); the
            # mapping goes when that view is collected. The name is already unlinked.
            pass

    def unlink(self) -> None:
        """Remove the segment's and semaphores' names; mapped handles stay valid."""
        _unlink_all(self.name, self.num_readers)


def _semaphore_names(name: str, num_readers: int) -> list[str]:
    return [f"{name}-w"] + [f"{name}-r{i}" for i in range(num_readers)]


def _unlink_all(name: str, num_readers: int) -> list[str]:
    """Unlink the semaphores, then the segment; return the names that existed."""
    # Semaphores first: a semaphore whose segment is gone is known stale (cleanup_stale).
    removed = [n for n in _semaphore_names(name, num_readers) if Doorbell.unlink(n)]
    try:
        posix_ipc.unlink_shared_memory(name)
        removed.append(name)
    except posix_ipc.ExistentialError:
        pass
    return removed


def cleanup_stale(prefix: str = "fe-") -> list[str]:
    """Remove ring segments and semaphores whose creating process is dead.

    Args:
        prefix: name prefix as in /dev/shm, with or without the leading "/"
            (e.g. "fe-" for every FlowEngine run, "fe-1a2b3c4d-" for one run).
    Returns:
        The POSIX names removed. Segments of live creators, of other users, or without
        a FlowEngine header are left alone; a semaphore whose segment is gone is stale.
    """
    prefix = prefix.lstrip("/")
    removed: list[str] = []
    entries = sorted(os.listdir(SHM_DIR))
    for entry in entries:
        if not entry.startswith(prefix):
            continue
        try:
            with open(os.path.join(SHM_DIR, entry), "rb") as f:
                header = f.read(CACHE_LINE_BYTES)
        except OSError:
            continue
        if len(header) < CACHE_LINE_BYTES:
            continue
        words = memoryview(header).cast("q")
        if words[MAGIC_W] != MAGIC or is_process_alive(
            words[CREATOR_PID_W], words[CREATOR_START_W]
        ):
            continue
        num_readers = min(max(words[NUM_READERS_W], 0), MAX_READERS)
        removed += _unlink_all("/" + entry, num_readers)
    for entry in sorted(os.listdir(SHM_DIR)):
        if entry.startswith("sem." + prefix):
            sem_name = entry[len("sem.") :]
            if not os.path.exists(os.path.join(SHM_DIR, sem_name.rsplit("-", 1)[0])):
                if Doorbell.unlink("/" + sem_name):
                    removed.append("/" + sem_name)
    return removed
