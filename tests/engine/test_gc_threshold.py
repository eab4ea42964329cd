"""gc_utils.raise_gen0_threshold: above one step's allocations, restored exactly."""

from __future__ import annotations

import gc

from flowengine.engine.gc_utils import (
    MAX_GEN0_THRESHOLD,
    OBJECTS_PER_REQUEST_STEP,
    raise_gen0_threshold,
    restore_gc_threshold,
)


def test_raise_and_restore_gen0_threshold() -> None:
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    try:
        previous = raise_gen0_threshold(1000)
        assert previous == (700, 10, 10)
        assert gc.get_threshold() == (OBJECTS_PER_REQUEST_STEP * 1000, 10, 10)
        # A second engine in the process: already high enough, nothing to undo.
        assert raise_gen0_threshold(256) is None
        assert gc.get_threshold() == (16_000, 10, 10)
        restore_gc_threshold(previous)
        assert gc.get_threshold() == (700, 10, 10)
        assert raise_gen0_threshold(10**9) == (700, 10, 10)
        assert gc.get_threshold()[0] == MAX_GEN0_THRESHOLD
        gc.set_threshold(0, 10, 10)  # collection switched off by the application: kept
        assert raise_gen0_threshold(1000) is None and gc.get_threshold()[0] == 0
    finally:
        gc.set_threshold(*before)
