"""Fixtures of the ring tests: unique run ids, and a check that no segment leaks."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
from shm_workers import SESSION_TAG, session_entries

_counter = itertools.count()


@pytest.fixture
def run_id() -> str:
    """A fresh run id carrying this session's tag."""
    return f"{SESSION_TAG}x{next(_counter)}"


@pytest.fixture(autouse=True, scope="session")
def no_segment_left_behind() -> Iterator[None]:
    """After the whole suite, no /dev/shm/fe-* or sem.fe-* entry of ours may remain."""
    yield
    assert session_entries() == [], "ring segments leaked into /dev/shm"
