"""DPRouter (pure data-parallel routing logic): least load, prefix affinity bounded by
imbalance, bookkeeping of finished requests, and failover of a lost replica."""

from __future__ import annotations

import random

import pytest

from flowengine.engine.dp_router import DPRouter, NoLiveReplicaError
from flowengine.messages import SchedulerStats


def _prompt(seed: int, num_tokens: int = 40) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(num_tokens)]


def test_spreads_distinct_prompts_evenly() -> None:
    router = DPRouter(2, block_size=16)
    picks = [router.route(f"r{i}", _prompt(i)) for i in range(8)]
    # No load reported yet: the frontend's own counts alternate the replicas.
    assert picks == [0, 1, 0, 1, 0, 1, 0, 1]
    assert [r.num_unfinished for r in router.replicas] == [4, 4]
    assert [r.num_routed_total for r in router.replicas] == [4, 4]


def test_least_loaded_uses_reported_stats_and_kv_usage() -> None:
    router = DPRouter(3, block_size=16, max_prefix_blocks=0)
    router.update_stats(0, SchedulerStats(num_running=5, num_waiting=2))
    router.update_stats(1, SchedulerStats(num_running=1, kv_cache_usage=0.9))
    router.update_stats(2, SchedulerStats(num_running=1, kv_cache_usage=0.2))
    # Loads 7, 1, 1: the tie between 1 and 2 goes to the lower KV usage.
    assert router.route("a", _prompt(1)) == 2
    # Now 2 holds max(1 unfinished, 1 reported) = 1 too; still the lower KV usage.
    assert router.route("b", _prompt(2)) == 2
    # 2's own count (2) exceeds its report (1): replica 1 (load 1) is the least.
    assert router.route("c", _prompt(3)) == 1


def test_prefix_affinity_and_its_imbalance_bound() -> None:
    router = DPRouter(2, block_size=16, max_imbalance=2)
    shared = _prompt(7, 48)
    assert router.route("a", shared + [1]) == 0
    # Same 3 leading blocks: replica 0 although it is the more loaded (1 vs 0).
    assert router.route("b", shared + [2]) == 0
    assert router.route("c", shared + [3]) == 0  # loads 2 vs 0: still within 2
    assert router.route("d", shared + [4]) == 1  # 3 vs 0 would exceed 2: least loaded
    # A different cache salt shares no prefix: least loaded (loads 3 vs 1 -> 1).
    assert router.route("e", shared, salt="tenant-b") == 1
    # A prompt shorter than a block hashes nothing: least loaded.
    assert router.prefix_hashes(shared[:15]) == []
    assert len(router.prefix_hashes(shared)) == 3


def test_longest_held_prefix_wins() -> None:
    router = DPRouter(2, block_size=16, max_imbalance=10)
    base = _prompt(3, 16)
    assert router.route("a", base + _prompt(4, 16)) == 0  # blocks b0, b1 -> 0
    assert router.route("b", _prompt(5, 32)) == 1
    # "c" shares only block 0 with "a": affinity to 0 (the deepest held prefix).
    assert router.route("c", base + _prompt(6, 16)) == 0


def test_finish_and_abort_bookkeeping() -> None:
    router = DPRouter(2, block_size=16, max_prefix_blocks=0)
    assert router.route("a", [1]) == 0
    assert router.route("b", [2]) == 1
    assert router.owner("a") == 0
    assert router.finish("a") == 0
    assert router.finish("a") is None  # twice (an abort after the finish) is harmless
    assert router.owner("a") is None
    assert [r.num_unfinished for r in router.replicas] == [0, 1]
    assert router.request_ids_of(1) == {"b"}
    # A resubmission (restart) keeps its replica and does not count twice.
    assert router.route("b", [2]) == 1
    assert [r.num_unfinished for r in router.replicas] == [0, 1]


def test_lost_replica_hands_its_requests_to_live_ones() -> None:
    router = DPRouter(3, block_size=16)
    shared = _prompt(9, 32)
    for i in range(6):
        router.route(f"r{i}", shared if i == 0 else _prompt(100 + i))
    held = router.mark_dead(0)
    assert held == {"r0", "r3"}
    assert router.num_alive == 2
    # Resubmitted: they move to live replicas, and 0's counts are released.
    moved = {rid: router.route(rid, shared if rid == "r0" else [5]) for rid in sorted(held)}
    assert set(moved.values()) <= {1, 2}
    assert router.replicas[0].num_unfinished == 0
    assert sum(r.num_unfinished for r in router.replicas) == 6
    # The lost replica's prefixes are forgotten: new work never goes there.
    assert all(router.route(f"n{i}", shared) != 0 for i in range(4))
    router.mark_dead(1)
    router.mark_dead(2)
    with pytest.raises(NoLiveReplicaError, match="every data-parallel replica is down"):
        router.route("late", [1])


def test_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="num_replicas must be >= 1"):
        DPRouter(0)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        DPRouter(2, block_size=0)


def test_restarting_replica_gets_no_new_work_while_another_can() -> None:
    router = DPRouter(2, block_size=16)
    shared = _prompt(11, 32)
    assert router.route("a", shared) == 0
    router.set_paused(0, True)
    # Not even its prefix draws new work to it while replica 1 serves.
    assert [router.route(f"b{i}", shared) for i in range(3)] == [1, 1, 1]
    # A resubmission keeps its (restarting) replica: its restart recomputes it.
    assert router.route("a", shared) == 0
    router.set_paused(1, True)  # both restarting: least loaded again
    assert router.route("c", _prompt(12)) == 0
    router.set_paused(0, False)
    router.set_paused(1, False)
    assert router.route("d", _prompt(13)) == 0  # loads 2 vs 3
