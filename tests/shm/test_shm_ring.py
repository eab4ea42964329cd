"""Point-to-point ring in one process: format, wraparound, limits, errors, idle cost."""

from __future__ import annotations

import errno
import os
import random
import stat
import threading
import time

import pytest
from shm_workers import check_record, make_record

from flowengine.shm import (
    ChannelClosedError,
    RecordTooLargeError,
    RingError,
    RingReader,
    RingWriter,
    create_ring,
    segment_name,
)
from flowengine.shm.segment import SHM_DIR


def test_send_recv_in_order(ring) -> None:
    writer, reader = ring
    assert reader.try_recv() is None
    for payload in (b"", b"a", b"12345678", b"x" * 1000):
        writer.send(payload)
    assert [reader.recv(timeout_s=1) for _ in range(4)] == [b"", b"a", b"12345678", b"x" * 1000]
    assert reader.try_recv() is None


def test_random_sizes_wrap_around(ring) -> None:
    # One thread plays both ends: the writer sends until the ring is full, then the
    # reader drains a little. A 4 KiB ring and records up to 1.2 KiB wrap constantly.
    writer, reader = ring
    rng = random.Random()
    in_flight: list[int] = []
    next_seq = expected = 0
    while expected < 5000:
        if next_seq < 5000 and writer.try_send(make_record(next_seq, rng.randrange(0, 1200))):
            in_flight.append(next_seq)
            next_seq += 1
            continue
        data = reader.try_recv()  # None when it only skipped a wrap marker
        if data is not None:
            assert check_record(data, expected) == in_flight.pop(0)
            expected += 1
    assert reader.try_recv() is None


def test_largest_record_fits_and_oversize_raises(ring) -> None:
    writer, reader = ring
    assert writer.max_payload_bytes == 4096 - 8
    biggest = bytes(range(256)) * 15 + b"z" * (writer.max_payload_bytes - 3840)
    writer.send(biggest, timeout_s=1)
    assert reader.recv(timeout_s=1) == biggest
    writer.send(b"small")
    assert reader.recv(timeout_s=1) == b"small"
    # Mid-lap, the biggest record needs the reader to skip the wrap marker first.
    assert not writer.try_send(biggest)
    assert reader.try_recv() is None
    assert writer.try_send(biggest)
    assert reader.recv(timeout_s=1) == biggest
    with pytest.raises(RecordTooLargeError, match=r"record of 4089 bytes .*\(4088 bytes"):
        writer.send(b"x" * 4089)  # raises at once, never waits for room
    with pytest.raises(ValueError):
        writer.try_send(b"x" * 100_000)


def test_full_ring_times_out_then_recovers(ring) -> None:
    writer, reader = ring
    while writer.try_send(b"y" * 500):
        pass
    with pytest.raises(TimeoutError, match="no room"):
        writer.send(b"y" * 500, timeout_s=0.05)
    assert writer.num_full_waits == 1
    # The reader hands room back every capacity/8 bytes and whenever it catches up.
    while reader.try_recv() is not None:
        pass
    writer.send(b"y" * 500, timeout_s=1)


def test_recv_timeout_and_close(ring) -> None:
    writer, reader = ring
    with pytest.raises(TimeoutError, match="no record within"):
        reader.recv(timeout_s=0.05)
    writer.send(b"last")
    writer.close()
    assert reader.recv(timeout_s=1) == b"last"  # drained before the close is reported
    with pytest.raises(ChannelClosedError):
        reader.recv(timeout_s=1)


def test_blocked_reader_is_woken_by_writer_thread(ring) -> None:
    writer, reader = ring
    timer = threading.Timer(0.2, writer.send, args=(b"wake",))
    timer.start()
    started = time.monotonic()
    assert reader.recv(timeout_s=5) == b"wake"
    assert time.monotonic() - started < 4  # woken by the doorbell, not by the timeout
    timer.join()


def test_idle_reader_burns_no_cpu(ring) -> None:
    _, reader = ring
    cpu_start = time.thread_time()
    with pytest.raises(TimeoutError):
        reader.recv(timeout_s=1.0)
    cpu_s = time.thread_time() - cpu_start
    assert cpu_s < 0.05, f"idle reader used {cpu_s * 100:.1f}% of a core"


def test_segment_and_semaphores_are_private(run_id: str) -> None:
    segment = create_ring("mode", 4096, run_id=run_id)
    try:
        base = segment.name[1:]
        for entry in (base, f"sem.{base}-w", f"sem.{base}-r0"):
            mode = stat.S_IMODE(os.stat(f"{SHM_DIR}/{entry}").st_mode)
            assert mode == 0o600, (entry, oct(mode))
    finally:
        segment.close()


def test_a_full_dev_shm_is_an_error_at_creation_not_a_sigbus(run_id, monkeypatch) -> None:
    # A segment larger than /dev/shm's free space (Docker's default is 64 MiB) was
    # created sparse, and the first write to a page tmpfs could not back killed the
    # process with SIGBUS. Its pages are now allocated at creation.
    def posix_fallocate(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", posix_fallocate)
    with pytest.raises(OSError, match=r"/dev/shm has no room for the 1 MiB shared-memory "
                                      r"ring /fe-.*-full \(\d+ MiB free\); give it more \("
                                      r"Docker: docker run --shm-size=1g, or --ipc=host\)"):
        create_ring("full", 1 << 20, run_id=run_id)
    assert not [e for e in os.listdir(SHM_DIR) if run_id in e]  # nothing left behind


def test_one_writer_and_one_reader_per_slot(run_id: str) -> None:
    segment = create_ring("slots", 4096, run_id=run_id)
    try:
        with RingWriter(segment), RingReader(segment):
            with pytest.raises(RingError, match="live writer"):
                RingWriter.attach(segment.name)
            with pytest.raises(RingError, match="held by live pid"):
                RingReader.attach(segment.name)
            with pytest.raises(ValueError, match="reader_index 1"):
                RingReader.attach(segment.name, 1)
        # Closed ends free their slots: the same process may attach again.
        RingWriter(segment).close()
        RingReader(segment).close()
    finally:
        segment.close()
    with pytest.raises(RingError, match="no shared memory segment"):
        RingReader.attach(segment.name)


def test_names_are_validated() -> None:
    assert segment_name("ab12", "steps") == "/fe-ab12-steps"
    with pytest.raises(ValueError, match="ring_name"):
        segment_name("ab12", "has-dash")
    with pytest.raises(ValueError, match="capacity_bytes"):
        create_ring("r", 100)
