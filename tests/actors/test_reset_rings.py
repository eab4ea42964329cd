"""The restart handshake's ring reset (`Supervisor._reset_rings`, DESIGN.md §8) also
reopens a ring whose old writer closed its end: `RingWriter.close()` sets the ring's
`closed` flag, and only a new writer's claim cleared it, so a new reader that attached
first (the new engine on "results" before the new executor claims it; an executor on
"steps" before the new engine) read the stream as ended (ChannelClosedError) instead of
waiting for the new writer."""

from __future__ import annotations

import pytest

from flowengine.actors.supervisor import Supervisor
from flowengine.shm import (
    BroadcastWriter,
    RingReader,
    RingWriter,
    create_broadcast_ring,
    create_ring,
    new_run_id,
)


def test_reset_rings_reopens_rings_whose_writer_closed() -> None:
    run_id = new_run_id()
    segments = {
        "requests": create_ring("requests", 4096, run_id=run_id),
        "steps": create_broadcast_ring("steps", 2, 4096, run_id=run_id),
        "results": create_ring("results", 4096, run_id=run_id),
    }
    try:
        steps, results = segments["steps"], segments["results"]
        # The old group: each writer closes its end on the way out, after its readers.
        old_readers = [RingReader(steps, 0), RingReader(steps, 1), RingReader(results)]
        RingReader(segments["requests"]).close()
        old_steps, old_results = BroadcastWriter(steps), RingWriter(results)
        old_steps.send(b"old plan")
        old_results.send(b"old result")
        old_steps.close()
        old_results.close()
        for reader in old_readers:
            reader.close()

        supervisor = Supervisor.__new__(Supervisor)  # only its rings are used
        supervisor._segments = segments
        supervisor._reset_rings()

        # The new group's readers attach before their rings' new writers do.
        engine = RingReader(results)
        ranks = [RingReader(steps, 0), RingReader(steps, 1)]
        for reader in (engine, *ranks):
            with pytest.raises(TimeoutError):
                reader.recv(timeout_s=0.02)  # waiting, not ChannelClosedError
        executor, scheduler = RingWriter(results), BroadcastWriter(steps)
        executor.send(b"ready")
        scheduler.send(b"plan 1")
        assert engine.recv(timeout_s=1.0) == b"ready"
        assert [r.recv(timeout_s=1.0) for r in ranks] == [b"plan 1", b"plan 1"]
        for end in (engine, *ranks, executor, scheduler):
            end.close()
    finally:
        for segment in segments.values():
            segment.close()
