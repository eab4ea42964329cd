"""The periodic engine-stats log line (`--disable-log-stats` turns it off), as vLLM prints it.

Every `interval_s` seconds (10 by default, `$FLOWENGINE_LOG_STATS_INTERVAL` changes it,
like vLLM's `VLLM_LOG_STATS_INTERVAL`) one line with the interval's prompt and generation
throughput, the running and waiting requests, the KV-cache usage and the prefix-cache hit
rate. Lines of an idle engine go to DEBUG, so an idle server does not fill its log; the
first idle interval after activity is still INFO, so the log shows the load drop to zero.

`StatLogLine` is pure (it turns two `EngineStats` snapshots into a line);
`StatLoggerActor` polls an engine's `get_stats()` on a timer (`AsyncEngine`), or when its
loop calls `log_if_due()` (the in-process `LLM`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from flowengine.engine.protocol import EngineStats

logger = logging.getLogger("flowengine.stats")

DEFAULT_LOG_STATS_INTERVAL_S = 10.0
LOG_STATS_INTERVAL_ENV = "FLOWENGINE_LOG_STATS_INTERVAL"


def log_stats_interval_s() -> float:
    """The interval from the environment, else 10 s. Raises ValueError (naming the
    variable) if it is not a number > 0."""
    raw = os.environ.get(LOG_STATS_INTERVAL_ENV)
    if raw is None:
        return DEFAULT_LOG_STATS_INTERVAL_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{LOG_STATS_INTERVAL_ENV} must be a number of seconds, "
                         f"got {raw!r}") from None
    if not value > 0:
        raise ValueError(f"{LOG_STATS_INTERVAL_ENV} must be > 0 seconds, got {raw!r}")
    return value


@dataclass(frozen=True)
class StatLogLine:
    """One interval's numbers. Throughputs in tokens/s; usage and hit rate in percent."""

    prompt_throughput: float
    generation_throughput: float
    num_running: int
    num_waiting: int
    kv_cache_usage_pct: float
    prefix_cache_hit_rate_pct: float

    @classmethod
    def between(cls, prev: EngineStats, now: EngineStats, elapsed_s: float) -> StatLogLine:
        """The line for the interval from snapshot `prev` to `now`, `elapsed_s` apart (> 0).

        The hit rate is hits / queried tokens of the prefix cache within the interval
        (0 when nothing was queried).
        """
        queries = now.prefix_cache_queries_total - prev.prefix_cache_queries_total
        hits = now.prefix_cache_hits_total - prev.prefix_cache_hits_total
        return cls(
            prompt_throughput=(now.prompt_tokens_total - prev.prompt_tokens_total) / elapsed_s,
            generation_throughput=(now.generation_tokens_total - prev.generation_tokens_total)
            / elapsed_s,
            num_running=now.num_running,
            num_waiting=now.num_waiting,
            kv_cache_usage_pct=100.0 * now.kv_cache_usage,
            prefix_cache_hit_rate_pct=100.0 * hits / queries if queries > 0 else 0.0,
        )

    @property
    def is_idle(self) -> bool:
        return not (self.prompt_throughput or self.generation_throughput
                    or self.num_running or self.num_waiting)

    def format(self) -> str:
        return (
            f"Avg prompt throughput: {self.prompt_throughput:.1f} tokens/s, "
            f"Avg generation throughput: {self.generation_throughput:.1f} tokens/s, "
            f"Running: {self.num_running} reqs, Waiting: {self.num_waiting} reqs, "
            f"KV cache usage: {self.kv_cache_usage_pct:.1f}%, "
            f"Prefix cache hit rate: {self.prefix_cache_hit_rate_pct:.1f}%"
        )


class StatLoggerActor:
    """Logs a `StatLogLine` every `interval_s` seconds from `get_stats()` snapshots.

    Runs as one more actor of the frontend's task group (`run()` never returns; it is
    cancelled with its siblings).
    """

    def __init__(self, get_stats: Callable[[], EngineStats], interval_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.get_stats = get_stats
        self.interval_s = log_stats_interval_s() if interval_s is None else interval_s
        self.clock = clock
        self._prev: tuple[float, EngineStats] | None = None
        self._last_was_idle = True

    def log_once(self) -> StatLogLine | None:
        """Take a snapshot and log the interval since the previous one (None the first time)."""
        now_s, stats = self.clock(), self.get_stats()
        prev, self._prev = self._prev, (now_s, stats)
        if prev is None or now_s <= prev[0]:
            return None
        line = StatLogLine.between(prev[1], stats, now_s - prev[0])
        level = logging.DEBUG if line.is_idle and self._last_was_idle else logging.INFO
        self._last_was_idle = line.is_idle
        logger.log(level, "%s", line.format())
        return line

    def log_if_due(self) -> StatLogLine | None:
        """`log_once()` when `interval_s` has passed since the last snapshot (or none was
        taken); for a synchronous loop such as the in-process `LLM`'s."""
        if self._prev is not None and self.clock() - self._prev[0] < self.interval_s:
            return None
        return self.log_once()

    async def run(self) -> None:
        self.log_once()
        while True:
            await asyncio.sleep(self.interval_s)
            self.log_once()
