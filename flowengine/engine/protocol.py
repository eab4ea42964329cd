"""What the serving layer needs from an engine: `EngineClient`.

`AsyncEngine` (flowengine/entrypoints/async_engine.py) implements it in either
placement (all actors in one process, or frontend / engine / executor processes).
The OpenAI server and the benchmarks depend only on this protocol.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from flowengine.outputs import RequestOutput
from flowengine.sampling_params import RequestOutputKind, SamplingParams


class EngineDeadError(RuntimeError):
    """The engine stopped and cannot be recovered; no request can be served."""


class EngineOverloadedError(RuntimeError):
    """Admission refused: the waiting queue is full. Retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass
class EngineStats:
    """A snapshot for /metrics (counters are totals since start; usage a fraction)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_preemptions_total: int = 0
    prefix_cache_queries_total: int = 0  # tokens looked up
    prefix_cache_hits_total: int = 0  # tokens found
    # Speculative decoding (SchedulerStats' spec_decode_* counters); per_pos is empty
    # when speculation is off, and then no spec_decode metric is exported (as vLLM).
    spec_decode_num_drafts_total: int = 0
    spec_decode_num_draft_tokens_total: int = 0
    spec_decode_num_accepted_tokens_total: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    finished_by_reason: dict[str, int] = field(default_factory=dict)
    # Cumulative per-request histograms by metric name (engine/request_stats.py).
    histograms: dict[str, Any] = field(default_factory=dict)
    # The KV cache configuration, as label values of cache_config_info.
    cache_config: dict[str, str] = field(default_factory=dict)
    # Data parallel: one snapshot per replica, by engine index (scheduler gauges and
    # counters, generation tokens); empty with one engine.
    per_engine: list[EngineStats] = field(default_factory=list)


class EngineClient(Protocol):
    """Async engine interface used by the server.

    `submit` yields `RequestOutput` deltas (new text/token ids only) until one with
    `finished=True`; breaking out of the loop or cancelling the task aborts the request
    and frees its KV blocks. Bad input raises `ValueError`/`TypeError` before any output;
    `EngineDeadError` if the engine is gone; `EngineOverloadedError` if the queue is full.
    """

    model_name: str
    max_model_len: int
    # The model's sampling defaults as SamplingParams keyword arguments (from
    # generation_config.json, e.g. {"temperature": 0.6, "max_tokens": 256}; {} if none);
    # set once start() returned. The OpenAI routes fill unset request fields from it.
    default_sampling_params: dict[str, Any]

    async def start(self) -> None:
        """Load the model and start serving (idempotent)."""
        ...

    def get_tokenizer(self) -> Any: ...

    def submit(
        self,
        prompt: str | list[int] | list[dict[str, Any]] | dict[str, Any],
        sampling_params: SamplingParams | None,
        request_id: str | None = None,
        *,
        priority: int = 0,
        output_kind: RequestOutputKind | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs; output_kind (None: sampling_params.output_kind, which
        defaults to CUMULATIVE) picks what each holds, as `AsyncEngine.submit`."""
        ...

    async def abort(self, request_id: str) -> None: ...

    async def check_health(self) -> None:
        """Raise EngineDeadError if the engine cannot serve."""
        ...

    def get_stats(self) -> EngineStats: ...

    async def shutdown(self, drain_timeout_s: float = 30.0) -> None:
        """Stop admission, let running requests finish (bounded), then stop."""
        ...
