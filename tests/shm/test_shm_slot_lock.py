"""Reader slot changes are atomic across processes: a claim (`RingReader` attaching)
racing a reap or `mark_reader_dead` can no longer leave the slot LIVE with token 0
(which wedged the writer) or DEAD with a valid token (the reader then returned
overwritten records). `_ring.cas64` is the primitive under the slot lock."""

from __future__ import annotations

import mmap
import multiprocessing as mp
import os
import subprocess
import sys
import time

import pytest
from shm_workers import claim_and_release

from flowengine.shm import RingReader, RingWriter, create_ring
from flowengine.shm._ring import cas64
from flowengine.shm.segment import (
    DEAD,
    LIVE,
    R_LOCK,
    R_PID,
    R_STATE,
    R_TOKEN,
    reader_ctl_word,
)


def test_cas64_swaps_only_on_the_expected_value():
    mm = mmap.mmap(-1, 64)
    words = memoryview(mm).cast("q")
    words[3] = 7
    assert cas64(mm, 3, 6, 9) is False and words[3] == 7
    assert cas64(mm, 3, 7, -(2**63)) is True and words[3] == -(2**63)
    assert [words[i] for i in (0, 1, 2, 4, 5, 6, 7)] == [0] * 7  # neighbours untouched
    with pytest.raises(IndexError, match="word 8 outside"):
        cas64(mm, 8, 0, 1)
    with pytest.raises(IndexError):
        cas64(mm, -1, 0, 1)
    with pytest.raises(BufferError, match="not writable"):
        cas64(b"\0" * 64, 0, 0, 1)  # read-only
    words.release()
    mm.close()


def _invariant_holds(segment) -> bool:
    w, ctl = segment.words, reader_ctl_word(0)
    state, token, pid = w[ctl + R_STATE], w[ctl + R_TOKEN], w[ctl + R_PID]
    if state == LIVE:
        return token != 0 and pid != 0
    if state == DEAD:
        return token == 0 and pid == 0
    return True


def test_claims_racing_mark_dead_keep_the_slot_consistent(run_id):
    segment = create_ring("t", 4096, run_id=run_id)
    ours, theirs = mp.get_context("spawn").Pipe()
    child = mp.get_context("spawn").Process(target=claim_and_release,
                                            args=(segment.name, 4.0, theirs))
    child.start()
    try:
        num_checks = num_kills = 0
        end = time.monotonic() + 30
        while child.is_alive() and time.monotonic() < end:
            segment.mark_reader_dead(0)  # as the supervisor or a reaping writer would
            num_kills += 1
            with segment._slot_locked(0):
                assert _invariant_holds(segment)
                num_checks += 1
        assert ours.poll(60)
        num_claims = ours.recv()
        child.join(30)
        assert child.exitcode == 0
        assert num_claims > 10 and num_kills > 10 and num_checks == num_kills
        # The slot still works: a fresh reader gets what a writer sends.
        segment.mark_reader_dead(0)
        writer, reader = RingWriter(segment), RingReader(segment)
        writer.send(b"after")
        assert reader.try_recv() == b"after"
        reader.close()
        writer.close()
    finally:
        if child.is_alive():
            child.kill()
        segment.close()


def test_lock_left_by_a_dead_process_is_taken_over(run_id):
    segment = create_ring("t", 4096, run_id=run_id)
    try:
        gone = subprocess.Popen([sys.executable, "-c", "pass"])
        gone.wait()
        segment.words[reader_ctl_word(0) + R_LOCK] = gone.pid  # died holding the lock
        reader = RingReader(segment)  # would spin forever if the lock were not freed
        assert segment.words[reader_ctl_word(0) + R_LOCK] == 0
        assert segment.reader_state(0) == LIVE
        segment.words[reader_ctl_word(0) + R_LOCK] = os.getpid()  # a reused pid of ours
        reader.close()
        assert segment.reader_state(0) == DEAD
        assert segment.words[reader_ctl_word(0) + R_LOCK] == 0
    finally:
        segment.close()
