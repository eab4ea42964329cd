"""The step scheduler: which requests run, how many tokens each, in which KV blocks.

Token-budget scheduling without prefill/decode phases, after vLLM v1's
`vllm/v1/core/sched/scheduler.py` (DESIGN.md §4). Each `schedule()`:

1. serves RUNNING requests in policy order, each `min(remaining, budget left)` tokens,
   where remaining = `num_tokens - num_computed_tokens`; when blocks run out the last
   running request (lowest priority) is preempted: blocks freed, recomputed later;
2. if nothing was preempted, admits WAITING requests in policy order while seats
   (`max_num_seqs`) and budget last, each starting after its prefix-cache hit.
   A prompt longer than the budget left is cut into chunks (chunked prefill) or, with
   chunked prefill off, waits for a step with room.

NOTE: after `schedule()` returns, `num_computed_tokens` of every scheduled request
already includes the tokens of that plan (optimistic, like vLLM v1), so the next plan
can be built before the results arrive. The plan itself carries the counts from before
the step. Executors apply a plan as: drop `finished_req_ids`, add `new_reqs`, update
`cached_reqs`, compute, and append the token they sample to their own copy of a
request whose known tokens are all computed. `finished_req_ids` of a plan with nothing
scheduled are repeated in the next plan, so such a plan may be skipped; executors must
ignore finished ids they do not hold.

Results may arrive one step late (two plans in flight): `update_from_output` works from
the counts inside the plan, skips requests preempted or finished since, and blocks are
published to the prefix cache only once their step has returned.

Pure Python: this module must not import torch.
"""

from __future__ import annotations

from collections.abc import Iterable

from flowengine.config import CacheConfig, SchedulerConfig
from flowengine.core.admission import check_request_fits, check_scheduler_config
from flowengine.core.block_pool import KVCacheBlock
from flowengine.core.kv_cache_manager import KVCacheManager, PrefixCacheStats
from flowengine.core.request_queue import PolicyKey, RequestQueue, policy_key
from flowengine.core.step_draft import StepDraft
from flowengine.core.stop_checker import append_token_ids
from flowengine.messages import (
    RequestDelta,
    SampledTokens,
    StepPlan,
    StepResult,
)
from flowengine.request import Request, RequestStatus


class Scheduler:
    """Plans steps over a paged KV cache and applies their results.

    Args:
        scheduler_config: token budget, seat limit, max_model_len, chunked prefill,
            policy ("fcfs" or "priority").
        cache_config: block size, number of blocks, prefix caching on/off.
        hash_seed: seed of the prefix-cache root hash (see kv_cache_utils).

    Raises ValueError when chunked prefill is off and max_num_batched_tokens is below
    max_model_len (such prompts could never be scheduled).

    The longest sequence is `max_len = min(max_model_len, num_blocks * block_size)`:
    a request reaching it ends with "length", so one request alone always fits in the
    KV cache and preemption can always make progress.
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
        )
        self.kv_capacity_tokens = cache_config.num_blocks * cache_config.block_size
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

    # ------------------------------------------------------------------ requests
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
                self._finish(request, status)

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request with this id, or None."""
        return self.requests.get(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks held by requests, in [0, 1]."""
        return self.kv_cache_manager.usage

    @property
    def num_free_blocks(self) -> int:
        """KV blocks not held by any request (evictable prefix-cache blocks included)."""
        return self.kv_cache_manager.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.kv_cache_manager.num_blocks

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self.kv_cache_manager.prefix_cache_stats

    @property
    def prefix_cache_queries(self) -> int:
        """Prompt tokens looked up in the prefix cache since start (first admissions)."""
        return self.prefix_cache_stats.num_queried_tokens

    @property
    def prefix_cache_hits(self) -> int:
        """Prompt tokens served from the prefix cache since start."""
        return self.prefix_cache_stats.num_hit_tokens

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> StepPlan:
        """Decide the next step. See the module docstring for the rules."""
        draft = StepDraft(token_budget=self.config.max_num_batched_tokens)
        self._schedule_running(draft)
        # After a preemption blocks are short: admitting now would only thrash.
        if draft.num_preempted == 0:
            self._schedule_waiting(draft)
        return self._make_plan(draft)

    def _schedule_running(self, draft: StepDraft) -> None:
        index = 0
        while index < len(self.running) and draft.token_budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, draft.token_budget)
            if num_new > 0:
                new_blocks = self._allocate_or_preempt(request, num_new, draft)
                if new_blocks is None:
                    return  # the request preempted itself: it was the last one running
                draft.add_cached(request, num_new, new_blocks)
            index += 1

    def _allocate_or_preempt(
        self, request: Request, num_new_tokens: int, draft: StepDraft
    ) -> list[KVCacheBlock] | None:
        """Allocate, preempting from the back of RUNNING until it fits; None if `request`
        itself had to go. Victims always sort after `request`, so none was scheduled."""
        while True:
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
            if new_blocks is not None:
                return new_blocks
            victim = self.running.last()
            self._preempt(victim)
            draft.num_preempted += 1
            if victim is request:
                return None

    def _preempt(self, request: Request) -> None:
        """Free the request's blocks and send it back to WAITING for recompute."""
        key = self._keys[request.request_id]
        self.running.remove(key)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add(key, request)
        self._finished_req_ids.append(request.request_id)

    def _schedule_waiting(self, draft: StepDraft) -> None:
        if not len(self.waiting):
            return
        pending = self.kv_cache_manager.unpublished_block_hashes(self.running)
        for request in self.waiting.snapshot():
            if len(self.running) >= self.config.max_num_seqs or draft.token_budget == 0:
                return
            hit_blocks, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
            if self._waits_for_shared_prefix(request, len(hit_blocks), pending):
                continue
            num_new = request.num_tokens - num_hit_tokens
            if num_new > draft.token_budget:
                if not self.config.enable_chunked_prefill:
                    return
                num_new = draft.token_budget
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new, hit_blocks)
            if new_blocks is None:
                return  # keep policy order: nobody overtakes a request short of blocks
            self._admit(request, num_hit_tokens)
            draft.add_new(request, num_new)
            pending |= self.kv_cache_manager.unpublished_block_hashes([request])

    def _waits_for_shared_prefix(
        self, request: Request, num_hit_blocks: int, pending: set[int]
    ) -> bool:
        """True if the request's first uncached block is being computed by another request.

        Siblings of an n > 1 request (and any prompts sharing a prefix) then compute the
        shared blocks once: the later one waits and hits the prefix cache next step.
        """
        if not pending or num_hit_blocks >= (request.num_tokens - 1) // self.block_size:
            return False
        return request.block_hashes[num_hit_blocks] in pending

    def _admit(self, request: Request, num_hit_tokens: int) -> None:
        key = self._keys[request.request_id]
        self.waiting.remove(key)
        self.running.add(key, request)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit_tokens
        if request.num_cached_tokens < 0:  # first admission, not a resume
            request.num_cached_tokens = num_hit_tokens
            if self.kv_cache_manager.enable_caching:
                self.prefix_cache_stats.record(request.num_tokens, num_hit_tokens)

    def _make_plan(self, draft: StepDraft) -> StepPlan:
        plan = draft.to_plan(
            self._next_step_id, list(self._finished_req_ids), self.kv_cache_manager.get_block_ids
        )
        self._next_step_id += 1
        # NOTE: an empty plan keeps its finished ids for the next plan too, so a caller
        # may skip sending plans with nothing scheduled without leaking executor state.
        if draft.num_scheduled:
            self._finished_req_ids = []
        # Optimistic: the plan's tokens count as computed from now on (module docstring).
        for req_id, num_tokens in draft.num_scheduled.items():
            self.requests[req_id].num_computed_tokens += num_tokens
        return plan

    # ------------------------------------------------------------------ results
    def update_from_output(self, plan: StepPlan, result: StepResult) -> list[RequestDelta]:
        """Apply a step's sampled tokens: publish computed blocks, append, check stops.

        Returns one RequestDelta per request that got tokens or finished. A result with
        `error` set finishes every unfinished request of the plan with finish_reason
        "error". Tokens sampled for a request still in prefill are discarded; a request
        whose tokens were all computed but that got no token finishes with an error.
        Requests aborted since the plan are skipped. Raises ValueError if the step ids
        differ.
        """
        if result.step_id != plan.step_id:
            raise ValueError(f"result of step {result.step_id} applied to plan {plan.step_id}")
        if result.error is not None:
            return self._fail_plan(plan, result.error)
        sampled = {s.req_id: s for s in result.sampled}
        entries = [*plan.new_reqs, *plan.cached_reqs]
        deltas = []
        for entry, num_scheduled in zip(entries, plan.num_scheduled_tokens, strict=True):
            request = self.requests.get(entry.req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            num_computed = entry.num_computed_tokens + num_scheduled
            self.kv_cache_manager.cache_blocks(request, num_computed)
            if num_computed >= request.num_tokens:
                deltas.append(self._append_sampled(request, sampled.get(entry.req_id)))
        return deltas

    def _append_sampled(self, request: Request, sampled: SampledTokens | None) -> RequestDelta:
        if sampled is None or not sampled.token_ids:
            error = f"the executor returned no token for request {request.request_id}"
            return self._fail_request(request, error)
        num_accepted, status = append_token_ids(request, sampled.token_ids, self.max_len)
        if status is not None:
            self._finish(request, status)
        logprobs = sampled.logprobs[:num_accepted] if sampled.logprobs is not None else None
        return RequestDelta(
            req_id=request.request_id,
            new_token_ids=sampled.token_ids[:num_accepted],
            new_logprobs=logprobs,
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
            num_cached_tokens=max(request.num_cached_tokens, 0),
        )

    def _fail_plan(self, plan: StepPlan, error: str) -> list[RequestDelta]:
        requests = [self.requests.get(req_id) for req_id in plan.scheduled_req_ids]
        return [self._fail_request(r, error) for r in requests if r is not None]

    def _fail_request(self, request: Request, error: str) -> RequestDelta:
        request.error = error
        self._finish(request, RequestStatus.FINISHED_ERROR)
        return RequestDelta(
            req_id=request.request_id,
            new_token_ids=[],
            finish_reason="error",
            num_cached_tokens=max(request.num_cached_tokens, 0),
            error=error,
        )

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """Take an unfinished request out of its queue, free its blocks, forget it."""
        key = self._keys.pop(request.request_id)
        if request.status == RequestStatus.RUNNING:
            self.running.remove(key)
            self._finished_req_ids.append(request.request_id)
        else:
            self.waiting.remove(key)
        request.status = status
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
