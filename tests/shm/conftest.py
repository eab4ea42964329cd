"""Fixtures of the ring tests: unique run ids, a small ring, and a check that no segment
leaks."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
from shm_workers import SESSION_TAG, session_entries

from flowengine.shm import RingReader, RingWriter, create_ring

_counter = itertools.count()


@pytest.fixture
def run_id() -> str:
    """A fresh run id carrying this session's tag."""
    return f"{SESSION_TAG}x{next(_counter)}"


@pytest.fixture
def ring(run_id: str) -> Iterator[tuple[RingWriter, RingReader]]:
    """(writer, reader) of a fresh 4 KiB point-to-point ring: small, so records wrap."""
    segment = create_ring("t", 4096, run_id=run_id)
    writer, reader = RingWriter(segment), RingReader(segment)
    yield writer, reader
    reader.close()
    writer.close()
    segment.close()


@pytest.fixture(autouse=True, scope="session")
def no_segment_left_behind() -> Iterator[None]:
    """After the whole suite, no /dev/shm/fe-* or sem.fe-* entry of ours may remain."""
    yield
    assert session_entries() == [], "ring segments leaked into /dev/shm"
