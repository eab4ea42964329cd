"""Garbage-collector hygiene for long-running engine processes."""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Move every object alive now (modules, weights' Python wrappers, tokenizer tables)
    to the collector's permanent generation.

    Without it each full collection rescans the ~10^5-10^6 objects left from start-up,
    which took about half of the actor pipeline's wall time in `flowengine bench
    pipeline`. vLLM does the same once its engine has started.
    """
    gc.collect()
    gc.freeze()


def thaw_heap() -> None:
    """Undo `freeze_startup_heap` when an engine stops inside a process that lives on
    (tests, notebooks, a server restarting its engine).

    NOTE: frozen objects are never collected, and an engine's object graph holds
    reference cycles (actors, callbacks), so without this every stopped in-process engine
    kept its model weights and KV cache for the life of the process (about 1.5 GB each
    for the default model).
    """
    gc.unfreeze()


# Tracked objects one engine step may allocate per running request and free again
# within the step (its RequestOutput, CompletionOutput and lists, futures, plan and
# delta lists): measured ~6-8 on the null-model pipeline; with a margin.
OBJECTS_PER_REQUEST_STEP = 16
MAX_GEN0_THRESHOLD = 100_000


def raise_gen0_threshold(max_num_seqs: int) -> tuple[int, ...] | None:
    """Raise the collector's generation-0 threshold above what one engine step
    allocates and frees again, so young collections stop running several times per
    step (each promotes the step's live outputs, which then cost again in generation 1).

    With the default 700, `flowengine bench pipeline` (1,000 streams) ran ~540
    generation-0, ~50 generation-1 and 4 full collections in 64 steps, about 15% of
    its time; with the threshold above the step's peak, 5 collections. The threshold is
    process-wide, like `gc.freeze` in `freeze_startup_heap`; cyclic garbage just waits
    a little longer. Returns the previous thresholds to give to
    `restore_gc_threshold`, or None if the threshold was already high enough.
    """
    wanted = min(MAX_GEN0_THRESHOLD, OBJECTS_PER_REQUEST_STEP * max(1, max_num_seqs))
    previous = gc.get_threshold()
    if previous[0] == 0 or previous[0] >= wanted:  # collection off, or already higher
        return None
    gc.set_threshold(wanted, *previous[1:])
    return previous


def restore_gc_threshold(previous: tuple[int, ...] | None) -> None:
    """Undo `raise_gen0_threshold` (an engine stopped inside a process that lives on)."""
    if previous is not None:
        gc.set_threshold(*previous)
