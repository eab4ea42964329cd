"""Rings across processes (spawn): ordering, integrity, wraparound, backpressure, lifetime.

Every record carries a sequence number and a CRC checked by the reading process, so
a torn record (a reader seeing the cursor before the payload), a stale one, or a
reuse of bytes still being read fails the test: this is the cross-process test of the
memory-ordering contract stated in flowengine/shm/record.py.
"""

from __future__ import annotations

import multiprocessing as mp
import random

import pytest
import shm_workers
from shm_workers import finish, make_record, run_reader, session_entries

from flowengine.shm import RingWriter, cleanup_stale, create_ring

CTX = mp.get_context("spawn")


def test_two_million_small_records(run_id: str) -> None:
    # A 64 KiB ring: small records (16-64 bytes) wrap it ~1000 times.
    segment = create_ring("small", 1 << 16, run_id=run_id)
    try:
        process, conn = run_reader(segment.name)
        num_records = 2_000_000
        with RingWriter(segment) as writer:
            for seq in range(num_records):
                writer.send(make_record(seq, seq % 49), timeout_s=60)
        assert finish(process, conn) == ("ok", num_records, 0, num_records - 1)
    finally:
        segment.close()


@pytest.mark.parametrize("batched", [False, True], ids=["recv", "recv_many"])
def test_random_sizes_force_wraparound(run_id: str, batched: bool) -> None:
    # Records up to 20 KiB in a 64 KiB ring: wrap markers at every position.
    segment = create_ring("sizes", 1 << 16, run_id=run_id)
    try:
        process, conn = run_reader(segment.name, batched=batched)
        rng = random.Random()
        with RingWriter(segment) as writer:
            for seq in range(40_000):
                writer.send(make_record(seq, rng.choice((0, 7, 8, 9, rng.randrange(20_000)))), 60)
        assert finish(process, conn) == ("ok", 40_000, 0, 39_999)
    finally:
        segment.close()


@pytest.mark.parametrize("batched", [False, True], ids=["recv", "recv_many"])
def test_slow_reader_applies_backpressure(run_id: str, batched: bool) -> None:
    segment = create_ring("slow", 4096, run_id=run_id)
    try:
        process, conn = run_reader(segment.name, sleep_every=50, batched=batched)
        rng = random.Random()
        with RingWriter(segment) as writer:
            for seq in range(3000):
                writer.send(make_record(seq, rng.randrange(200)), timeout_s=60)
            num_full_waits = writer.num_full_waits
        assert finish(process, conn) == ("ok", 3000, 0, 2999)  # nothing dropped
        assert num_full_waits > 0, "the writer never had to wait: no backpressure tested"
    finally:
        segment.close()


@pytest.mark.parametrize("clean_exit", [True, False], ids=["atexit", "crash"])
def test_owner_exit_and_stale_cleanup(run_id: str, clean_exit: bool) -> None:
    ours, theirs = CTX.Pipe()
    process = CTX.Process(
        target=shm_workers.create_and_vanish, args=("gone", run_id, theirs, clean_exit)
    )
    process.start()
    assert ours.poll(60)
    name = ours.recv()
    process.join(30)
    live = create_ring("alive", 4096, run_id=run_id)  # same prefix, live creator
    try:
        prefix = f"fe-{run_id}-"
        left = {e for e in session_entries() if e.startswith((prefix, "sem." + prefix))}
        base = name[1:]
        stale = {base, f"sem.{base}-w", f"sem.{base}-r0"}
        if clean_exit:
            assert not left & stale  # the owner's atexit hook unlinked everything
        else:
            assert stale <= left
            removed = cleanup_stale(prefix)
            assert sorted(removed) == sorted("/" + e.removeprefix("sem.") for e in stale)
        assert cleanup_stale(prefix) == []  # the live creator's ring is left alone
        assert live.name[1:] in session_entries()
    finally:
        live.close()
