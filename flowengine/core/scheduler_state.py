"""The requests a scheduler owns and their life cycle (DESIGN.md §4).

`SchedulerState` holds the `Request`s, their WAITING and RUNNING queues in policy
order, the KV cache manager and the steps in flight, and moves a request between
states: add, admit, preempt, append sampled tokens (stop checks), finish, abort.
Freeing blocks waits for the last in-flight step that writes them (DESIGN.md §5).
Which requests run in a step is decided by the `Scheduler` (scheduler.py), which owns
one `SchedulerState` and changes it only through the public methods below.

Pure Python: this module must not import torch.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from flowengine.config import CacheConfig, SchedulerConfig
from flowengine.core.admission import check_request_fits, check_scheduler_config
from flowengine.core.in_flight import InFlightSteps
from flowengine.core.kv_cache_manager import KVCacheManager, PrefixCacheStats
from flowengine.core.request_queue import PolicyKey, RequestQueue, policy_key
from flowengine.core.stop_checker import append_token_ids, check_stop
from flowengine.messages import RequestDelta, SampledTokens, SchedulerStats
from flowengine.request import Request, RequestStatus


class SchedulerState:
    """Requests, queues, KV blocks and steps in flight; see `Scheduler` for the args.

    Attributes:
        requests: unfinished requests by id.
        waiting, running: the queues, each in policy order.
        kv_cache_manager: the KV blocks (and prefix cache) of every request.
        in_flight: records of the plans whose results are not applied yet.
        max_len: the longest sequence, min(max_model_len, KV cache tokens).

    Raises ValueError when chunked prefill is off and max_num_batched_tokens is below
    max_model_len (such prompts could never be scheduled).
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        *,
        hash_seed: str = "",
    ) -> None:
        config = scheduler_config
        check_scheduler_config(config)
        self.config = config
        self.cache_config = cache_config
        self.block_size = cache_config.block_size
        self.kv_cache_manager = KVCacheManager(
            cache_config.num_blocks,
            cache_config.block_size,
            cache_config.enable_prefix_caching,
            hash_seed,
            cache_config.sliding_window,
        )
        self.kv_capacity_tokens = cache_config.num_usable_blocks * cache_config.block_size
        self.max_len = min(config.max_model_len, self.kv_capacity_tokens)
        self.requests: dict[str, Request] = {}
        self.waiting = RequestQueue()
        self.running = RequestQueue()
        self._keys: dict[str, PolicyKey] = {}
        self._num_added = 0
        self._next_step_id = 0
        # Requests the executors may hold and must drop: sent with the next plan.
        self._finished_req_ids: list[str] = []
        self.num_preemptions = 0
        self.in_flight = InFlightSteps()
        # The StructuredOutputManager (set by the Scheduler), told of finished requests.
        self.structured_outputs: Any = None

    def add_request(self, request: Request) -> None:
        """Queue a new request (status WAITING).

        Raises ValueError, leaving the scheduler unchanged, for a duplicate id, an empty
        prompt, a prompt longer than max_model_len, or one larger than the KV cache
        (see `admission.check_request_fits`).
        """
        if request.request_id in self.requests:
            raise ValueError(
                f"request id {request.request_id!r} is in use; give each request a unique id"
            )
        check_request_fits(request, self.config, self.cache_config)
        request.status = RequestStatus.WAITING
        key = policy_key(self.config.policy, request, self._num_added)
        self._num_added += 1
        self.requests[request.request_id] = request
        self._keys[request.request_id] = key
        self.waiting.add(key, request)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """End requests with a finished `status` (abort, stop string); frees their blocks.

        Unknown or already finished ids are ignored. Raises ValueError if `status` is not
        a finished status.
        """
        if not status.is_finished:
            raise ValueError(f"status must be a FINISHED_* status, got {status.name}")
        for req_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            request = self.requests.get(req_id)
            if request is not None:
                self.finish(request, status)

    def abort_requests(self, request_ids: Iterable[str]) -> list[RequestDelta]:
        """Finish live requests as aborted (their blocks are freed, see `finish`).

        Returns one "abort" RequestDelta per request that was still unfinished; unknown
        and already finished ids are ignored (an abort may cross the request's end).
        """
        deltas = []
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is not None:
                self.finish(request, RequestStatus.FINISHED_ABORTED)
                deltas.append(RequestDelta(req_id, [], finish_reason="abort"))
        return deltas

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request with this id, or None."""
        return self.requests.get(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self.kv_cache_manager.prefix_cache_stats

    def make_stats(self) -> SchedulerStats:
        """Snapshot of the gauges and counters (vLLM's `Scheduler.make_stats`)."""
        stats = self.prefix_cache_stats
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            num_free_blocks=self.kv_cache_manager.num_free_blocks,
            num_total_blocks=self.kv_cache_manager.num_usable_blocks,  # no null block
            num_preemptions_total=self.num_preemptions,
            prefix_cache_queries_total=stats.num_queried_tokens,
            prefix_cache_hits_total=stats.num_hit_tokens,
        )

    # ------------------------------------------------------------------ transitions
    def next_step_id(self) -> int:
        """A fresh step id (0, 1, 2, ...)."""
        step_id = self._next_step_id
        self._next_step_id += 1
        return step_id

    def take_finished_req_ids(self, *, keep: bool) -> list[str]:
        """Ids the executors must drop, for the next plan. With `keep` (a plan that
        schedules nothing, which a caller may skip sending) they stay queued for the
        plan after it too; a copy is returned."""
        if keep:
            return list(self._finished_req_ids)
        finished, self._finished_req_ids = self._finished_req_ids, []
        return finished

    def preempt(self, request: Request) -> None:
        """Free the request's blocks and send it back to WAITING for recompute."""
        key = self._keys[request.request_id]
        self.running.remove(key)
        self._free_blocks(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add(key, request)
        self._finished_req_ids.append(request.request_id)

    def admit(self, request: Request, num_hit_tokens: int) -> None:
        """Move a WAITING (or PREEMPTED) request to RUNNING with `num_hit_tokens` tokens
        from the prefix cache; its blocks are allocated already."""
        key = self._keys[request.request_id]
        self.waiting.remove(key)
        self.running.add(key, request)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit_tokens
        if request.num_cached_tokens < 0:  # first admission, not a resume
            request.num_cached_tokens = num_hit_tokens
            request.scheduled_time = time.monotonic()
            if self.kv_cache_manager.enable_caching:
                self.prefix_cache_stats.record(request.num_tokens, num_hit_tokens)

    def append_sampled(self, request: Request, sampled: SampledTokens | None) -> RequestDelta:
        """Append a step's tokens with stop checks (also to a request preempted since
        that step: its token was sampled from the right history); finish on a stop.
        No token at all fails the request; a pooled vector (pooling runner) finishes
        it instead of a token. Returns the request's delta."""
        if sampled is not None and sampled.pooled is not None:
            return self.finish_pooled(request, sampled.pooled)
        if sampled is None or not sampled.token_ids:
            error = f"the executor returned no token for request {request.request_id}"
            return self.fail_request(request, error)
        token_ids = sampled.token_ids
        if len(token_ids) == 1:  # one token per step unless decoding speculatively
            request.output_token_ids.append(token_ids[0])
            num_accepted, status = 1, check_stop(request, self.max_len)
        else:
            num_accepted, status = append_token_ids(request, token_ids, self.max_len)
        finish_reason = None
        if status is not None:
            self.finish(request, status)
            finish_reason = status.finish_reason
        logprobs = sampled.logprobs
        if num_accepted < len(token_ids):
            token_ids = token_ids[:num_accepted]
            logprobs = logprobs[:num_accepted] if logprobs is not None else None
        return RequestDelta(
            request.request_id,
            token_ids,
            logprobs,
            finish_reason,
            request.stop_reason,
            request.num_cached_tokens if request.num_cached_tokens > 0 else 0,
            prompt_logprobs=sampled.prompt_logprobs,
            # Once, with the first tokens: when the request was first scheduled.
            scheduled_ts=(request.scheduled_time
                          if len(request.output_token_ids) == num_accepted else 0.0),
        )

    def finish_pooled(self, request: Request, pooled: bytes) -> RequestDelta:
        """Finish a prefill-only request of the pooling runner with its pooled vector
        (finish_reason "stop"); its blocks are freed at once (none is kept after the
        request). Returns its delta."""
        self.finish(request, RequestStatus.FINISHED_STOPPED)
        return RequestDelta(request.request_id, [], finish_reason="stop",
                            scheduled_ts=request.scheduled_time, pooled=pooled)

    def fail_request(self, request: Request, error: str) -> RequestDelta:
        """Finish an unfinished request with `error`; returns its "error" delta."""
        request.error = error
        self.finish(request, RequestStatus.FINISHED_ERROR)
        return RequestDelta(
            req_id=request.request_id,
            new_token_ids=[],
            finish_reason="error",
            num_cached_tokens=max(request.num_cached_tokens, 0),
            error=error,
        )

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Take an unfinished request out of its queue, free its blocks, forget it."""
        key = self._keys.pop(request.request_id)
        if request.status == RequestStatus.RUNNING:
            self.running.remove(key)
            self._finished_req_ids.append(request.request_id)
        else:
            self.waiting.remove(key)
        request.status = status
        self._free_blocks(request)
        del self.requests[request.request_id]
        if self.structured_outputs is not None:
            self.structured_outputs.remove(request.request_id)

    def _free_blocks(self, request: Request) -> None:
        """Free the request's blocks now, or once the last in-flight step that writes
        them has completed (no block is reused while a step writes it)."""
        self.kv_cache_manager.free(request, after_step=self.in_flight.last_step_of(request))
