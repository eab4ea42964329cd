"""Request statistics summed over API server processes (engine/frontend_stats.py)."""

from __future__ import annotations

import os
import stat

from flowengine.engine.frontend_stats import SharedFrontendStats, counters_of, merged
from flowengine.engine.protocol import EngineStats
from flowengine.engine.request_stats import HistogramData


def _stats(prompt: int, gen: int, finished: dict[str, int], ttft_counts: list[int],
           ttft_sum: float, running: int = 7) -> EngineStats:
    return EngineStats(
        num_running=running, num_waiting=1, kv_cache_usage=0.25, prompt_tokens_total=prompt,
        generation_tokens_total=gen, num_preemptions_total=3, finished_by_reason=finished,
        histograms={"time_to_first_token_seconds": HistogramData((0.1, 1.0), ttft_counts,
                                                                  ttft_sum)})


def test_frontend_counters_add_up_and_engine_figures_stay(tmp_path):
    run = "0a1b2c3d"
    procs = [SharedFrontendStats(run, i, 3, shm_dir=str(tmp_path)) for i in range(3)]
    own = _stats(100, 40, {"stop": 2}, [1, 2, 2], 0.9)
    procs[1].publish(_stats(10, 5, {"stop": 1, "length": 4}, [0, 3, 5], 2.5, running=99))
    procs[2].publish(_stats(1, 2, {"abort": 1}, [1, 1, 1], 0.05))
    path = tmp_path / f"fe-{run}-stats1"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    total = merged(own, procs[0].others())
    assert (total.prompt_tokens_total, total.generation_tokens_total) == (111, 47)
    assert total.finished_by_reason == {"stop": 3, "length": 4, "abort": 1}
    ttft = total.histograms["time_to_first_token_seconds"]
    assert ttft.counts == [2, 6, 8] and abs(ttft.sum - 3.45) < 1e-12
    # The engine's own gauges and counters are this process's (the same everywhere).
    assert (total.num_running, total.num_waiting, total.kv_cache_usage,
            total.num_preemptions_total) == (7, 1, 0.25, 3)
    # Merging copies: this process's own snapshot is unchanged.
    assert own.histograms["time_to_first_token_seconds"].counts == [1, 2, 2]
    assert own.finished_by_reason == {"stop": 2}


def test_missing_corrupt_and_mismatched_files_are_skipped(tmp_path):
    run = "0a1b2c3d"
    procs = [SharedFrontendStats(run, i, 3, shm_dir=str(tmp_path)) for i in range(3)]
    own = _stats(5, 5, {}, [0, 1, 1], 0.5)
    assert merged(own, procs[0].others()) == own  # nobody published yet
    (tmp_path / f"fe-{run}-stats2").write_bytes(b"\xc1 not msgpack")
    other = _stats(1, 1, {}, [1, 1, 1], 0.01)
    other.histograms["time_to_first_token_seconds"] = HistogramData((0.5,), [1, 1], 0.01)
    procs[1].publish(other)
    total = merged(own, procs[0].others())
    assert total.prompt_tokens_total == 6
    # Different bucket edges cannot be summed: this process's histogram stands.
    assert total.histograms["time_to_first_token_seconds"].counts == [0, 1, 1]
    assert counters_of(own).prompt_tokens_total == 5
    procs[0].remove_all()
    assert not list(tmp_path.iterdir())


def test_a_restarted_process_counts_on_from_its_predecessor(tmp_path):
    """Totals are Prometheus counters: they must not drop when process 1 dies and a new
    process 1 starts from zero."""
    run = "0a1b2c3d"
    first = SharedFrontendStats(run, 1, 2, shm_dir=str(tmp_path))
    assert first.base is None
    first.publish(_stats(10, 20, {"stop": 3}, [1, 2, 3], 0.5))
    p0 = SharedFrontendStats(run, 0, 2, shm_dir=str(tmp_path))
    before = p0.total(_stats(1, 1, {}, [0, 0, 0], 0.0))
    assert (before.prompt_tokens_total, before.finished_by_reason) == (11, {"stop": 3})
    # kill -9 of process 1; its successor has counted only 2 tokens so far.
    second = SharedFrontendStats(run, 1, 2, shm_dir=str(tmp_path))
    assert second.base is not None and second.base.prompt_tokens_total == 10
    fresh = _stats(2, 4, {"length": 1}, [0, 1, 1], 0.25)
    second.publish(fresh)
    after = p0.total(_stats(1, 1, {}, [0, 0, 0], 0.0))
    assert (after.prompt_tokens_total, after.generation_tokens_total) == (13, 25)
    assert after.finished_by_reason == {"stop": 3, "length": 1}
    assert after.histograms["time_to_first_token_seconds"].counts == [1, 3, 4]
    # Its own view counts the predecessor's share too.
    assert second.total(fresh).prompt_tokens_total == 12  # process 0 published nothing


def test_publish_does_not_follow_a_link_planted_at_the_temporary_name(tmp_path):
    # /dev/shm is writable by every user; the temporary file had a fixed name opened
    # with O_CREAT | O_TRUNC, so a planted symlink made the server overwrite its target.
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    shm = tmp_path / "shm"
    shm.mkdir()
    run = "0a1b2c3d"
    (shm / f"fe-{run}-stats1.tmp").symlink_to(victim)
    procs = [SharedFrontendStats(run, i, 2, shm_dir=str(shm)) for i in range(2)]
    procs[1].publish(_stats(10, 5, {"stop": 1}, [0, 1, 0], 0.5))
    assert victim.read_bytes() == b"keep me"
    assert stat.S_IMODE(os.stat(shm / f"fe-{run}-stats1").st_mode) == 0o600
    assert procs[0].others()[0] == counters_of(_stats(10, 5, {"stop": 1}, [0, 1, 0], 0.5))
    procs[0].remove_all()  # the files, and the link (unlinked, never followed)
    assert list(shm.iterdir()) == [] and victim.read_bytes() == b"keep me"
