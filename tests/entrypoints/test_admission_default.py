"""The default --max-queue-len rule (flowengine/core/admission.py)."""

from __future__ import annotations

from flowengine.core.admission import QUEUE_BATCHES, default_max_queue_len


def test_default_queue_len_is_two_batches_of_the_seats_that_can_run():
    assert QUEUE_BATCHES == 2
    assert default_max_queue_len(256, 10_000) == 512  # seats: max_num_seqs
    assert default_max_queue_len(256, 40) == 80  # seats: KV blocks (>= 1 block each)
    assert default_max_queue_len(8, 0) == 16  # KV blocks unknown: max_num_seqs alone
    assert default_max_queue_len(1, 1) == 2
