"""Broadcast ring: every reader sees every record; dead readers neither block nor corrupt."""

from __future__ import annotations

import os
import random
import signal
import threading

import pytest
from shm_workers import finish, make_record, run_reader

from flowengine.shm import (
    BroadcastWriter,
    ReaderDetachedError,
    RingReader,
    RingWriter,
    create_broadcast_ring,
)
from flowengine.shm.segment import DEAD, LIVE, RESERVED


def test_four_readers_see_every_record(run_id: str) -> None:
    segment = create_broadcast_ring("steps", 4, 1 << 16, run_id=run_id)
    try:
        # Two readers take one record per call, two every published record per call.
        readers = [run_reader(segment.name, i, batched=i % 2 == 1) for i in range(4)]
        rng = random.Random()
        num_records = 100_000
        with BroadcastWriter(segment) as writer:
            for seq in range(num_records):
                body_bytes = rng.randrange(8000) if seq % 100 == 0 else seq % 49
                writer.send(make_record(seq, body_bytes), timeout_s=60)
        for process, conn in readers:
            assert finish(process, conn) == ("ok", num_records, 0, num_records - 1)
    finally:
        segment.close()


def test_killed_reader_is_reaped_and_can_reattach(run_id: str) -> None:
    # Reader 2 stops after 1000 records and is SIGKILLed; the writer, blocked on the
    # full 16 KiB ring, notices its pid is gone, stops waiting for it, and goes on. The
    # other readers must see every record intact; a restarted reader 2 re-attaches at
    # the write cursor and sees everything after it.
    segment = create_broadcast_ring("steps", 3, 1 << 14, run_id=run_id)
    try:
        healthy = [run_reader(segment.name, i, batched=i == 1) for i in (0, 1)]
        doomed, doomed_conn = run_reader(segment.name, 2, stall_after=1000)

        def kill_when_stalled() -> None:
            assert doomed_conn.poll(60)
            assert doomed_conn.recv() == ("stalled", 1000)
            os.kill(doomed.pid, signal.SIGKILL)

        killer = threading.Thread(target=kill_when_stalled)
        killer.start()
        first_batch, second_batch = 20_000, 5_000
        with BroadcastWriter(segment) as writer:
            for seq in range(first_batch):
                writer.send(make_record(seq, seq % 49), timeout_s=60)
            killer.join(30)
            doomed.join(30)
            assert doomed.exitcode == -signal.SIGKILL
            assert segment.reader_state(2) == DEAD
            assert writer.live_readers() == [0, 1]
            assert writer.num_full_waits > 0

            reborn, reborn_conn = run_reader(segment.name, 2)
            assert writer.live_readers() == [0, 1, 2]
            for seq in range(first_batch, first_batch + second_batch):
                writer.send(make_record(seq, seq % 49), timeout_s=60)
        total = first_batch + second_batch
        for process, conn in healthy:
            assert finish(process, conn) == ("ok", total, 0, total - 1)
        assert finish(reborn, reborn_conn) == ("ok", second_batch, first_batch, total - 1)
    finally:
        segment.close()


def test_unattached_reader_keeps_records_and_mark_dead_unblocks(run_id: str) -> None:
    segment = create_broadcast_ring("steps", 2, 4096, run_id=run_id)
    try:
        writer = BroadcastWriter(segment)
        fast = RingReader(segment, 0)
        assert segment.reader_state(1) == RESERVED
        sent = 0
        while writer.try_send(make_record(sent, 100)):
            assert fast.try_recv() is not None
            sent += 1
        # Reader 1 has not attached yet: its records are kept, the ring is full.
        assert fast.try_recv() is None
        late = RingReader(segment, 1)
        assert segment.reader_state(1) == LIVE
        assert late.recv(timeout_s=1) == make_record(0, 100)  # nothing was lost

        writer.mark_reader_dead(1)  # e.g. the supervisor gave up on a hung reader
        writer.send(make_record(sent, 100), timeout_s=1)  # room again at once
        with pytest.raises(ReaderDetachedError):
            late.recv(timeout_s=1)
        successor = RingReader(segment, 1)
        late.close()  # a detached reader's close must not detach its successor
        assert segment.reader_state(1) == LIVE
        writer.send(b"to both")
        assert successor.recv(timeout_s=1) == b"to both"
        assert fast.recv(timeout_s=1) == make_record(sent, 100)
        successor.close()
        assert segment.reader_state(1) == DEAD
        fast.close()
        writer.close()
    finally:
        segment.close()


def test_point_to_point_writer_refuses_broadcast_segment(run_id: str) -> None:
    segment = create_broadcast_ring("steps", 2, 4096, run_id=run_id)
    try:
        with pytest.raises(ValueError, match="use BroadcastWriter"):
            RingWriter(segment)
    finally:
        segment.close()
