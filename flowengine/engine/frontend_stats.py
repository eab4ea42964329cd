"""What each API server process counts, summed over all of them (`--api-server-count`).

The engine's own gauges and counters (running, waiting, KV cache usage, preemptions,
prefix cache) reach every API server process with each step's outputs, so every
process already reports the same values. What a frontend counts itself, per request
it served (prompt and generation tokens, finished requests by reason, the latency and
size histograms), lives in that process only: a Prometheus scrape or the stats log line
of one process would show its share. So each process publishes its counters to a small
file of its own (`/dev/shm/fe-<run>-stats<i>`, mode 0600, replaced atomically about
once a second) and adds the others' latest to its own when asked (`merged`): the same
totals in every process, at most PUBLISH_INTERVAL_S old for the other processes' part.
vLLM does the same job with prometheus_client's multiprocess mode (files per process,
summed at scrape).

NOTE: the totals are Prometheus counters and must never go down. So a process started
again in the place of a dead one (same index) counts on from its predecessor's last
published figures (its file is still there), and the files stay until process 0, the
last to stop, removes them all (`remove_all`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import tempfile
from collections import Counter

import msgspec

from flowengine.engine.protocol import EngineStats
from flowengine.engine.request_stats import HistogramData
from flowengine.shm.segment import segment_name

PUBLISH_INTERVAL_S = 1.0
SHM_DIR = "/dev/shm"


class FrontendCounters(msgspec.Struct, frozen=True):
    """One process's frontend-counted totals (EngineStats' frontend fields)."""

    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    finished_by_reason: dict[str, int] = {}
    # name -> (bucket edges, cumulative counts with +Inf last, sum)
    histograms: dict[str, tuple[list[float], list[int], float]] = {}


def counters_of(stats: EngineStats) -> FrontendCounters:
    return FrontendCounters(
        stats.prompt_tokens_total, stats.generation_tokens_total,
        dict(stats.finished_by_reason),
        {name: (list(h.buckets), list(h.counts), h.sum) for name, h in stats.histograms.items()},
    )


def merged(stats: EngineStats, others: list[FrontendCounters]) -> EngineStats:
    """`stats` with the other processes' frontend counters added (histograms whose
    bucket edges differ from this process's are left out of the sum: they cannot be)."""
    if not others:
        return stats
    finished = Counter(stats.finished_by_reason)
    histograms = {name: HistogramData(h.buckets, list(h.counts), h.sum)
                  for name, h in stats.histograms.items()}
    prompt, generation = stats.prompt_tokens_total, stats.generation_tokens_total
    for other in others:
        prompt += other.prompt_tokens_total
        generation += other.generation_tokens_total
        finished.update(other.finished_by_reason)
        for name, (buckets, counts, total) in other.histograms.items():
            mine = histograms.get(name)
            if mine is None:
                histograms[name] = HistogramData(tuple(buckets), list(counts), total)
            elif list(mine.buckets) == list(buckets) and len(mine.counts) == len(counts):
                mine.counts = [a + b for a, b in zip(mine.counts, counts, strict=True)]
                mine.sum += total
    return dataclasses.replace(stats, prompt_tokens_total=prompt,
                               generation_tokens_total=generation,
                               finished_by_reason=dict(finished), histograms=histograms)


def stats_path(run_id: str, index: int, shm_dir: str = SHM_DIR) -> str:
    """API server `index`'s file: named like the run's ring segments (`segment_name`)."""
    return os.path.join(shm_dir, segment_name(run_id, f"stats{index}").lstrip("/"))


def remove_run_files(run_prefix: str, shm_dir: str = SHM_DIR) -> None:
    """Remove every stats file of the run whose segments start with `run_prefix`
    ("fe-<run_id>-"); for the run's last survivor when process 0 is gone."""
    for entry in os.listdir(shm_dir):
        if entry.startswith(run_prefix + "stats"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(shm_dir, entry))


class SharedFrontendStats:
    """This process's file and the others' of one run.

    Args:
        run_id: the engine run's id (its ring names' "fe-<run_id>-" prefix).
        index: this API server process's index; count: how many there are.
        shm_dir: where the files live (tests use a temporary directory).
    """

    def __init__(self, run_id: str, index: int, count: int, shm_dir: str = SHM_DIR) -> None:
        if not 0 <= index < count:
            raise ValueError(f"index {index} out of range [0, {count})")
        self.index = index
        self.paths = [stats_path(run_id, i, shm_dir) for i in range(count)]
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(FrontendCounters)
        # A predecessor's last figures (this index ran before and died): counted on from.
        self.base = self._read(self.paths[index])

    def _read(self, path: str) -> FrontendCounters | None:
        try:
            with open(path, "rb") as f:
                return self._decoder.decode(f.read())
        except (OSError, msgspec.DecodeError):
            return None  # not published yet, or (never seen) a torn file

    def _own(self, stats: EngineStats) -> EngineStats:
        return stats if self.base is None else merged(stats, [self.base])

    def publish(self, stats: EngineStats) -> None:
        """Write this process's counters (atomically: a reader sees the old or the new)."""
        path = self.paths[self.index]
        # NOTE: a fresh random name (O_EXCL | O_NOFOLLOW, mode 0600), never a fixed one:
        # /dev/shm is writable by every user, and a link planted at a predictable name
        # would have this process truncate and overwrite the file it points to.
        fd, tmp = tempfile.mkstemp(prefix=f"{os.path.basename(path)}.tmp",
                                   dir=os.path.dirname(path))
        try:
            os.write(fd, self._encoder.encode(counters_of(self._own(stats))))
        finally:
            os.close(fd)
        os.replace(tmp, path)

    def others(self) -> list[FrontendCounters]:
        """The other processes' latest counters (a missing or unreadable file: none yet)."""
        found = [self._read(path) for i, path in enumerate(self.paths) if i != self.index]
        return [c for c in found if c is not None]

    def total(self, stats: EngineStats) -> EngineStats:
        """This process's `stats` with every process's frontend counters summed."""
        return merged(self._own(stats), self.others())

    def remove_all(self) -> None:
        """Remove every process's file (process 0, once the others have stopped)."""
        for path in self.paths:
            for name in (path, *glob.glob(f"{glob.escape(path)}.tmp*")):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name)
