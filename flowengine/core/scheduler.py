"""The step scheduler: which requests run, how many tokens each, in which KV blocks.

Token-budget scheduling without prefill/decode phases, after vLLM v1's
`vllm/v1/core/sched/scheduler.py` (DESIGN.md §4). Each `schedule()`:

1. serves RUNNING requests in policy order, each `min(remaining, budget left)` tokens,
   where remaining = `num_tokens - num_computed_tokens`; when blocks run out the last
   running request (lowest priority) is preempted: blocks freed, recomputed later.
   Blocks that in-flight steps still write come free only after those steps, so once
   they cover the need no more requests are preempted: the request waits a step;
2. if no running request was short of blocks, admits WAITING requests in policy order
   while seats (`max_num_seqs`) and budget last, each after its prefix-cache hit.
   A prompt longer than the budget left is cut into chunks (chunked prefill) or, with
   chunked prefill off, waits for a step with room.

NOTE: after `schedule()` returns, `num_computed_tokens` of every scheduled request
already includes the tokens of that plan (optimistic, like vLLM v1), so the next plan
can be built before the results arrive. The plan itself carries the counts from before
the step. Executors apply plans as `StepPlan`'s docstring says (flowengine/messages.py).
`finished_req_ids` of a plan with nothing scheduled are repeated in the next plan, so
such a plan may be skipped; executors must ignore finished ids they do not hold.

Plans in flight (DESIGN.md §5): results may arrive after the next plan is made; they
must be applied once each, in plan order. Two modes:

- default: a request that samples in step N is scheduled again only once N's result
  is applied (only prefill chunks overlap);
- `async_scheduling=True`: step N+1 is planned as if every request that samples in an
  in-flight step already had that token (a placeholder, see `in_flight.py`): remaining
  = num_tokens + placeholders - num_computed_tokens. The executor, which appends each
  token it samples to its own copy of the request before running the next plan, has
  that token when N+1 runs. A request that stops on step N's token had a speculative
  token in N+1, dropped when N+1's result arrives; a request that its in-flight tokens
  surely bring to max_tokens or max_len gets no speculative token at all.

Structured outputs (`structured_output_manager`, flowengine/structured_outputs/): a
constrained request waits in WAITING while its grammar compiles (vLLM's
WAITING_FOR_FSM; others are admitted past it) and fails there if it does not compile.
The next-token bitmask of a plan's constrained sampling rows is filled from matchers
that have accepted every earlier token, so step N+1's mask *waits for* step N's token
and is *fixed after* it, never guessed: when a constrained row of N+1 samples on a
placeholder (async scheduling), the plan goes out at once with
`pending_structured_output_tokens` set and no bitmask, so the executor runs N+1's
forward while N's token travels back; `update_from_output` of N advances the matchers
and then fills N+1's bitmask, which the driver takes with `take_grammar_outputs()` and
sends (a `GrammarOutput`) before the next plan, and the executor samples N+1 with it
(vLLM's async scheduling with structured outputs). A constrained request thus decodes
in every step in both modes. Otherwise the bitmask travels in the plan itself, unless
`defer_grammar_bitmask` is set (drivers that launch a forward before sampling it):
then every plan with constrained rows goes out pending, and the driver calls
`fill_grammar_bitmasks()` right after sending or launching it, so the mask is filled
while the device runs the forward (vLLM v1's execute_model, grammar bitmask,
sample_tokens), then sends the `GrammarOutput`. A token the grammar refuses fails the
request.

Speculative decoding (`proposer`, core/spec_tokens.py): a decoding request may be
scheduled for its last token plus draft tokens, all in the token budget and with KV
slots allocated before the step (never by preempting others: short of blocks, it runs
without drafts); after the step the rejected drafts are rolled back
(`num_computed_tokens` and trailing blocks). With async scheduling a request is then
never planned on a placeholder (its number of accepted tokens is known only from the
result).

In both modes stop checks run on the tokens in order, so outputs equal the
non-overlapped engine's and no token past a stop is ever delivered. Blocks of a
request that finishes, is preempted or is aborted while an in-flight step writes them
are freed only once that step has completed. A request preempted with tokens in flight
keeps them (each was sampled once, from its correct history, as the non-overlapped
engine would) and resumes only after they all arrived, so its recompute holds exactly
its accepted tokens. Results of requests finished or aborted since their plan are
dropped, and blocks are published to the prefix cache only once their step returned.

Pure Python: this module must not import torch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from itertools import chain
from typing import Any

from flowengine.config import CacheConfig, SchedulerConfig
from flowengine.core.block_pool import KVCacheBlock
from flowengine.core.in_flight import ScheduledRequest
from flowengine.core.kv_cache_manager import PrefixCacheStats
from flowengine.core.scheduler_state import SchedulerState
from flowengine.core.spec_tokens import DraftProposer, SpecDecodeState
from flowengine.core.step_draft import NO_NEW_BLOCKS, StepDraft
from flowengine.messages import (
    REQUEST_ERROR_PREFIX,
    GrammarOutput,
    RequestDelta,
    SchedulerStats,
    StepPlan,
    StepResult,
)
from flowengine.request import Request, RequestStatus

_RUNNING = RequestStatus.RUNNING


class Scheduler:
    """Plans steps over a paged KV cache and applies their results.

    Args:
        scheduler_config: token budget, seat limit, max_model_len, chunked prefill,
            policy ("fcfs" or "priority").
        cache_config: block size, number of blocks, prefix caching on/off.
        hash_seed: seed of the prefix-cache root hash (see kv_cache_utils).
        async_scheduling: plan each step as if the requests that sample in in-flight
            steps already had their tokens (module docstring, DESIGN.md §5). Off: a
            request waits for its last step's result before it is scheduled again.
            May be changed between steps.
        structured_output_manager: compiles grammars and keeps the matchers of
            constrained requests (a `StructuredOutputManager`); None refuses requests
            with structured_outputs.
        defer_grammar_bitmask: send every plan with constrained sampling rows
            without its bitmask (pending_structured_output_tokens) and fill it in
            `fill_grammar_bitmasks()`, which the driver calls once the plan's forward is
            launched (module docstring). May be changed between steps.
        proposer: speculative decoding's draft-token proposer (the n-gram proposer of
            flowengine/spec_decode); None: no speculation.

    Raises ValueError when chunked prefill is off and max_num_batched_tokens is below
    max_model_len (such prompts could never be scheduled).

    The longest sequence is `max_len = min(max_model_len, num_blocks * block_size)`:
    a request reaching it ends with "length", so one request alone always fits in the
    KV cache and preemption can always make progress.

    The requests and their life cycle live in `state` (a `SchedulerState`, which this
    object owns and changes only through its public methods); the methods and
    properties below that are not about planning hand through to it.
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        *,
        hash_seed: str = "",
        async_scheduling: bool = False,
        structured_output_manager: Any = None,
        proposer: DraftProposer | None = None,
        defer_grammar_bitmask: bool = False,
    ) -> None:
        self.state = state = SchedulerState(scheduler_config, cache_config, hash_seed=hash_seed)
        self.async_scheduling = async_scheduling
        self.structured_outputs = state.structured_outputs = structured_output_manager
        # Deltas made while planning (a request whose grammar failed to compile); the
        # engine core takes them after each schedule().
        self.pending_deltas: list[RequestDelta] = []
        self.defer_grammar_bitmask = defer_grammar_bitmask
        # Plans sent with pending_structured_output_tokens, oldest first: (step id, the
        # constrained requests that sample in it, whether their matchers held every
        # earlier token when it was planned); and their bitmasks once filled.
        self._deferred_bitmasks: deque[tuple[int, list[Request], bool]] = deque()
        self._grammar_outputs: list[GrammarOutput] = []
        # A driver that can run grammar work off its thread (the Scheduler actor) sets
        # this: a result with at least this many constrained rows leaves their matchers'
        # advance and the next bitmask fill to `take_grammar_work()` (None: inline).
        self.grammar_offload_rows: int | None = None
        # The accepted tokens of constrained requests that update_from_output left to
        # take_grammar_work: (request, its delta) in plan order.
        self._grammar_backlog: list[tuple[Request, RequestDelta]] = []
        self._grammar_work_out = False  # a take_grammar_work() job not finished yet
        # The state's long-lived parts, bound once: the planning loops read them on
        # every step.
        self.config = state.config
        self.cache_config = state.cache_config
        self.block_size = state.block_size
        self.max_len = state.max_len
        self.kv_cache_manager = state.kv_cache_manager
        self.requests = state.requests
        self.waiting = state.waiting
        self.running = state.running
        self.in_flight = state.in_flight
        self.spec = None if proposer is None else SpecDecodeState(proposer, self.max_len)
        # Pipeline parallelism (set by the engine's builder): the steps in flight are
        # micro-batches, each of at most 1/num_micro_batches of the running requests, so
        # decode batches fill every stage; and plans carry the output tokens they
        # compute (stages other than the last never sample them).
        self.num_micro_batches = 1
        self.include_new_token_ids = False

    # ------------------------------------------------------------------ life cycle
    def add_request(self, request: Request) -> None:
        """Queue a new request (WAITING); raises ValueError as SchedulerState.add_request,
        or for structured_outputs without a structured output manager. A constrained
        request's grammar starts compiling here."""
        if (request.sampling_params.structured_outputs is not None
                and self.structured_outputs is None):
            raise ValueError("this engine has no structured output support (its scheduler "
                             "was built without a StructuredOutputManager)")
        self.state.add_request(request)
        if self.structured_outputs is not None:
            self.structured_outputs.add_request(request)

    @property
    def num_compiling_grammars(self) -> int:
        """Constrained requests that wait for their grammar to compile."""
        return 0 if self.structured_outputs is None else self.structured_outputs.num_compiling

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """End requests with a finished status (SchedulerState.finish_requests)."""
        self.state.finish_requests(request_ids, status)

    def abort_requests(self, request_ids: Iterable[str]) -> list[RequestDelta]:
        """Abort live requests; one "abort" delta each (SchedulerState.abort_requests)."""
        return self.state.abort_requests(request_ids)

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request with this id, or None."""
        return self.requests.get(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def make_stats(self) -> SchedulerStats:
        """Snapshot of the gauges and counters for /metrics."""
        stats = self.state.make_stats()
        if self.spec is not None:
            for name, value in self.spec.stats().items():
                setattr(stats, name, value)
        return stats
    # ------------------------------------------------------------------ gauges
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_steps_in_flight(self) -> int:
        """Plans with scheduled tokens whose results have not been applied yet."""
        return len(self.in_flight)

    @property
    def num_preemptions(self) -> int:
        """Preemptions since start."""
        return self.state.num_preemptions

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
        """KV blocks requests can hold: the cache's blocks less a window's null block
        (which is never free), so `num_total_blocks - num_free_blocks` is what requests
        hold and the KV-cache fit and usage see the real capacity."""
        return self.kv_cache_manager.num_usable_blocks

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self.kv_cache_manager.prefix_cache_stats

    @property
    def prefix_cache_queries(self) -> int:
        """Prompt tokens looked up in the prefix cache since start (first admissions)."""
        return self.kv_cache_manager.prefix_cache_stats.num_queried_tokens

    @property
    def prefix_cache_hits(self) -> int:
        """Prompt tokens served from the prefix cache since start."""
        return self.kv_cache_manager.prefix_cache_stats.num_hit_tokens

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> StepPlan:
        """Decide the next step. See the module docstring for the rules."""
        draft = StepDraft(token_budget=self.config.max_num_batched_tokens)
        self._schedule_running(draft)
        # Blocks are short (a preemption, or blocks still in flight): admitting now
        # would only thrash.
        if not draft.is_short_of_blocks:
            self._schedule_waiting(draft)
        return self._make_plan(draft)

    def _num_known_tokens(self, request: Request, num_tokens: int) -> int:
        """With async scheduling: the request's `num_tokens` plus its placeholders, or its
        `num_computed_tokens` (nothing to compute) when those surely end it by length."""
        num_placeholders = self.in_flight.num_placeholders(request)
        if num_placeholders and (
            # With speculation the accepted count is known only from the result.
            self.spec is not None
            or request.num_output_tokens + num_placeholders >= request.max_tokens
            or num_tokens + num_placeholders >= self.max_len
        ):
            return request.num_computed_tokens  # a speculative token could never be delivered
        return num_tokens + num_placeholders

    def _schedule_running(self, draft: StepDraft) -> None:
        # NOTE: hot path, run for every running request on every step; keep it lean.
        running = self.running.requests  # preemption pops from its end: index stays valid
        manager = self.kv_cache_manager
        req_to_blocks = manager.req_to_blocks
        block_size = self.block_size
        with_placeholders = self.async_scheduling and len(self.in_flight) > 0
        budget = draft.token_budget
        spec = self.spec
        index = 0
        # Pipeline micro-batches: requests of an in-flight step are skipped below, so
        # the next step takes the next share.
        seats = len(running) if self.num_micro_batches == 1 else \
            -(-len(running) // self.num_micro_batches)
        while index < len(running) and budget > 0 and seats > 0:
            request = running[index]
            index += 1
            num_known = len(request.prompt_token_ids) + len(request.output_token_ids)
            if with_placeholders:
                num_known = self._num_known_tokens(request, num_known)
            num_computed = request.num_computed_tokens
            num_new = min(num_known - num_computed, budget)
            if num_new <= 0:
                continue
            drafts = None
            if spec is not None and num_new == 1 and num_known == num_computed + 1 and budget > 1:
                drafts = spec.drafts_for(request, budget - 1)
                num_new += len(drafts)
            new_blocks: Sequence[KVCacheBlock] | None
            # Most decode steps: the tokens fit in the blocks the request holds.
            if num_computed + num_new <= len(req_to_blocks[request.request_id]) * block_size:
                new_blocks = NO_NEW_BLOCKS
            else:
                new_blocks = manager.allocate_slots(request, num_new)
                if new_blocks is None and drafts:
                    # Never preempt anyone for draft tokens: run without them.
                    drafts, num_new = None, 1
                    new_blocks = manager.allocate_slots(request, num_new)
                if new_blocks is None:
                    new_blocks = self._preempt_for(request, num_new, draft)
                    if new_blocks is None:
                        break  # it preempted itself (the last one running) or waits
            draft.cached_reqs.append(request)  # draft.add_cached, inlined
            draft.cached_num_tokens.append(num_new)
            draft.cached_new_blocks.append(new_blocks)
            draft.cached_num_known.append(num_known)
            if drafts:
                draft.draft_token_ids[request.request_id] = drafts
            budget -= num_new
            seats -= 1
        draft.token_budget = budget

    def _preempt_for(
        self, request: Request, num_new_tokens: int, draft: StepDraft
    ) -> list[KVCacheBlock] | None:
        """`request` found too few free blocks: preempt from the back of RUNNING until
        its allocation fits. Victims always sort after `request`, so none was scheduled
        in this draft.

        Returns None when `request` gets no blocks this step: it had to go itself, or
        the blocks that in-flight steps will release cover it. Victims' blocks are
        freed only after their in-flight steps, so preempting until blocks are free
        right now would preempt every request in flight; the request waits a step.
        """
        manager = self.kv_cache_manager
        draft.is_short_of_blocks = True
        while True:
            num_coming = manager.num_free_blocks + manager.num_deferred_free_blocks
            if num_coming >= manager.num_new_blocks_for(request, num_new_tokens):
                return None
            victim = self.running.last()
            self.state.preempt(victim)
            if victim is request:
                return None
            new_blocks = manager.allocate_slots(request, num_new_tokens)
            if new_blocks is not None:
                return new_blocks

    def _schedule_waiting(self, draft: StepDraft) -> None:
        manager = self.kv_cache_manager
        waiting = self.waiting.requests  # admitting removes the request at `index`
        pending: set[int] | None = None  # hashes being computed, gathered when first needed
        grammars = self.structured_outputs
        index = 0
        while index < len(waiting):
            if len(self.running) >= self.config.max_num_seqs or draft.token_budget == 0:
                return
            request = waiting[index]
            if self.in_flight.num_placeholders(request):
                return  # preempted with tokens in flight: resume it with them (docstring)
            if grammars is not None and request.sampling_params.structured_outputs is not None:
                status = grammars.poll(request)
                if status == "compiling":
                    index += 1  # WAITING_FOR_FSM: the requests behind it go first
                    continue
                if status is not None:  # it leaves `waiting`: the next one is at `index`
                    self.pending_deltas.append(self.state.fail_request(request, status))
                    continue
            hit_blocks, num_hit_tokens = manager.get_computed_blocks(request)
            if (manager.enable_caching and request.sampling_params.prompt_logprobs is None
                    and len(hit_blocks) < self._num_cacheable_blocks(request)):
                if pending is None:
                    # Requests admitted earlier in this loop are in RUNNING already.
                    pending = manager.unpublished_block_hashes(self.running)
                if pending and request.block_hashes[len(hit_blocks)] in pending:
                    # Another request computes its first uncached block: it waits and hits
                    # the prefix cache next step (n > 1 siblings compute the prompt once).
                    index += 1
                    continue
            num_new = request.num_tokens - num_hit_tokens
            if num_new > draft.token_budget:
                if not self.config.enable_chunked_prefill:
                    return
                num_new = draft.token_budget
            new_blocks = manager.allocate_slots(request, num_new, hit_blocks)
            if new_blocks is None:
                return  # keep policy order: nobody overtakes a request short of blocks
            self.state.admit(request, num_hit_tokens)
            draft.add_new(request, num_new)
            if pending is not None:
                pending |= manager.unpublished_block_hashes([request])

    def _num_cacheable_blocks(self, request: Request) -> int:
        """Full blocks before the request's last token: the most a prefix-cache hit covers."""
        return (request.num_tokens - 1) // self.block_size

    def _make_plan(self, draft: StepDraft) -> StepPlan:
        step_id = self.state.next_step_id()
        # NOTE: an empty plan keeps its finished ids for the next plan too, so a caller
        # may skip sending plans with nothing scheduled without leaking executor state.
        finished_req_ids = self.state.take_finished_req_ids(keep=not draft.num_scheduled_reqs)
        # Optimistic: the plan's tokens count as computed from now on (module docstring).
        # A request whose computed tokens reach its last known or placeholder token
        # samples one token in this step (the executor's rule, see StepPlan).
        plan, scheduled = draft.commit(
            step_id, finished_req_ids, self.kv_cache_manager.get_block_ids,
            self.include_new_token_ids,
        )
        if scheduled:
            self.in_flight.add(step_id, scheduled)
            grammars = self.structured_outputs
            if grammars is not None and grammars.num_matchers:
                self._add_bitmask(plan, scheduled, grammars)
        return plan

    def _add_bitmask(self, plan: StepPlan, scheduled: dict[str, ScheduledRequest],
                     grammars: Any) -> None:
        """Fill the next-token bitmask of the plan's constrained sampling rows, or, when
        one of them samples on a placeholder (a token an earlier in-flight step
        samples), mark the plan pending and fill it once that step's result is applied
        (module docstring). Called after the plan joined `in_flight`."""
        is_constrained = grammars.has_matcher
        records = [record for rid, record in scheduled.items()
                   if record.samples and is_constrained(rid)]
        if not records:
            return
        num_placeholders = self.in_flight.num_placeholders
        # The plan's own token counts once: more means an earlier step's is pending.
        waits = any(num_placeholders(record.request) > 1 for record in records)
        if waits or self.defer_grammar_bitmask:
            plan.pending_structured_output_tokens = True
            self._deferred_bitmasks.append(
                (plan.step_id, [r.request for r in records], not waits))
            return
        req_ids = [record.request.request_id for record in records]
        plan.structured_output_req_ids = req_ids
        plan.grammar_bitmask = grammars.fill_bitmask(req_ids)

    def take_grammar_outputs(self) -> list[GrammarOutput]:
        """The bitmasks of pending plans (`pending_structured_output_tokens`) that
        `update_from_output` filled, oldest first; clears them. Send each to the
        executors before the next plan."""
        outputs, self._grammar_outputs = self._grammar_outputs, []
        return outputs

    def fill_grammar_bitmasks(self) -> list[GrammarOutput]:
        """Fill the bitmasks of the pending plans that can be filled now (a plan
        deferred by `defer_grammar_bitmask` at once; one waiting for an earlier step's
        tokens once that step was applied), in plan order, and return every filled one
        (`take_grammar_outputs`). Call right after launching a plan's forward."""
        if self._deferred_bitmasks:
            self._fill_deferred_bitmasks()
        return self.take_grammar_outputs()

    def _fill_deferred_bitmasks(self) -> None:
        """Fill the bitmask of each pending plan whose requests' matchers hold every
        token before the one it samples (ready when planned, or all earlier steps
        applied), oldest first: GrammarOutputs go out in plan order."""
        grammars = self.structured_outputs
        for step_id, req_ids in self._ready_deferred_bitmasks():
            bitmask = grammars.fill_bitmask(req_ids) if req_ids else b""
            self._grammar_outputs.append(GrammarOutput(step_id, req_ids, bitmask))

    def _ready_deferred_bitmasks(self) -> list[tuple[int, list[str]]]:
        """Take the pending plans whose bitmask can be filled now (see
        `_fill_deferred_bitmasks`): (step id, the ids of its rows), oldest first."""
        deferred = self._deferred_bitmasks
        oldest = self.in_flight.oldest_step_id
        grammars = self.structured_outputs
        live = self.requests
        ready = []
        while deferred and (deferred[0][2] or oldest is None or deferred[0][0] <= oldest):
            step_id, requests, _ = deferred.popleft()
            # Finished (or failed, aborted) since the plan: no row, its token is dropped.
            ready.append((step_id, [r.request_id for r in requests
                                    if live.get(r.request_id) is r
                                    and grammars.has_matcher(r.request_id)]))
        return ready

    # ------------------------------------------------------------------ results
    def update_from_output(self, plan: StepPlan, result: StepResult) -> list[RequestDelta]:
        """Apply a step's sampled tokens: publish computed blocks, append, check stops.

        Apply each plan with scheduled tokens once, in the order the plans were made
        (plans without scheduled tokens need no result and give no deltas). Returns one
        RequestDelta per request that got tokens or finished. A result with `error` set
        finishes every unfinished request of the plan with finish_reason "error".
        Tokens sampled for a request still in prefill are discarded; a request that was
        to sample but got no token finishes with an error. Requests finished or aborted
        since the plan are skipped (a speculative token is dropped here). Raises
        ValueError if the step ids differ or results come out of order.
        """
        if result.step_id != plan.step_id:
            raise ValueError(f"result of step {result.step_id} applied to plan {plan.step_id}")
        if not plan.num_scheduled_tokens:
            return []
        if self._grammar_backlog or self._grammar_work_out:
            raise ValueError(f"result of step {plan.step_id} applied before the grammar work "
                             "of the previous result was finished (take_grammar_work)")
        if self._deferred_bitmasks and self._deferred_bitmasks[0][0] <= plan.step_id:
            raise ValueError(f"result of step {plan.step_id} applied before the grammar "
                             f"bitmask of step {self._deferred_bitmasks[0][0]} was filled")
        scheduled = self.in_flight.complete(plan.step_id)
        if result.error is not None:
            deltas = self._fail_plan(plan, scheduled, result.error)
        else:
            deltas = self._apply_sampled(plan, scheduled, result)
        # NOTE: only now has this step stopped writing the blocks deferred until it.
        self.kv_cache_manager.release_deferred(plan.step_id)
        if self._deferred_bitmasks and not self._grammar_backlog:
            self._fill_deferred_bitmasks()
        return deltas

    def _apply_sampled(
        self, plan: StepPlan, scheduled: dict[str, ScheduledRequest], result: StepResult
    ) -> list[RequestDelta]:
        # NOTE: hot path, run for every scheduled request on every step; keep it lean.
        sampled = {s.req_id: s for s in result.sampled}
        requests = self.requests
        cache_blocks = self.kv_cache_manager.cache_blocks
        num_cached_blocks = self.kv_cache_manager.num_cached_blocks
        windowed = self.kv_cache_manager.sliding_window is not None
        block_size = self.block_size
        append_sampled = self.state.append_sampled
        grammars = self.structured_outputs
        if grammars is not None and not grammars.num_matchers:
            grammars = None
        plan_drafts = None
        if self.spec is not None:
            plan_drafts = {c.req_id: c.draft_token_ids for c in plan.cached_reqs
                           if c.draft_token_ids}
        deltas = []
        advance: list[tuple[Request, RequestDelta]] = []  # constrained: matchers to advance
        entries = chain(plan.new_reqs, plan.cached_reqs)
        for entry, num_scheduled in zip(entries, plan.num_scheduled_tokens, strict=True):
            req_id = entry.req_id
            record = scheduled[req_id]
            request = record.request
            if requests.get(req_id) is not request:
                continue  # finished or aborted since the plan
            # A request preempted since the plan holds other blocks now: publish none.
            if request.status is _RUNNING and request.num_preemptions == record.num_preemptions:
                num_computed = entry.num_computed_tokens + num_scheduled
                # Skip the call on most decode steps: no block filled up (cache_blocks
                # would return at once).
                if num_computed // block_size > num_cached_blocks.get(req_id, 0):
                    cache_blocks(request, num_computed)
            if record.samples:
                tokens = sampled.get(req_id)
                if plan_drafts and req_id in plan_drafts:
                    self._roll_back_drafts(request, record, plan_drafts[req_id], tokens)
                if tokens is not None and tokens.draft_token_ids:
                    request.spec_token_ids = tokens.draft_token_ids  # a draft model's
                delta = append_sampled(request, tokens)
                deltas.append(delta)
                if grammars is not None and delta.finish_reason is None and delta.new_token_ids:
                    advance.append((request, delta))
            if (windowed and request.status is _RUNNING
                    and request.num_preemptions == record.num_preemptions):
                # NOTE: after publishing (a freed block stays a prefix-cache entry) and
                # after any draft rollback. Later plans (in flight or not) start at or
                # past this count, so none reads the blocks freed here.
                self.kv_cache_manager.remove_skipped_blocks(request, min(
                    entry.num_computed_tokens + num_scheduled, request.num_computed_tokens))
        if advance:
            assert grammars is not None
            offload = self.grammar_offload_rows
            if offload is not None and len(advance) >= offload:
                self._grammar_backlog = advance  # take_grammar_work() advances them
            else:
                self._advance_matchers(advance, grammars)
        return deltas

    def _roll_back_drafts(self, request: Request, record: ScheduledRequest,
                          drafts: list[int], sampled: Any) -> None:
        """A step verified `drafts` of `request`: count them, and take the rejected
        ones' KV back (num_computed_tokens, trailing blocks: core/spec_tokens.py). The
        executor returned the accepted drafts plus one token."""
        if sampled is None or not sampled.token_ids:
            return  # append_sampled fails the request
        num_accepted = min(len(sampled.token_ids) - 1, len(drafts))
        assert self.spec is not None
        self.spec.record(len(drafts), num_accepted)
        if request.status is not _RUNNING or request.num_preemptions != record.num_preemptions:
            return  # preempted since the plan: its blocks are gone already
        # NOTE: no later plan in flight computes this request (it is never planned on a
        # placeholder while speculation is on), so these blocks are written by no one.
        request.num_computed_tokens -= len(drafts) - num_accepted
        self.kv_cache_manager.trim(request, request.num_computed_tokens)

    def _advance_matchers(self, advance: list[tuple[Request, RequestDelta]],
                          grammars: Any) -> None:
        """Feed each request's accepted tokens to its matcher (one batched call); a
        refused token (the output left its grammar, which the mask should make
        impossible) fails the request, in the same delta."""
        accepted = _accept_batch(grammars, [(request.request_id, delta.new_token_ids)
                                            for request, delta in advance])
        for (request, delta), ok in zip(advance, accepted, strict=True):
            if not ok:
                error = _refused(request, delta)
                _drop_refused_tokens(request, delta)
                failed = self.state.fail_request(request, error)
                delta.finish_reason, delta.error = failed.finish_reason, failed.error

    def take_grammar_work(self) -> Callable[[], Any] | None:
        """The grammar work that the last update_from_output left (`grammar_offload_rows`):
        a function to run off the driver's thread (GIL released inside the grammar
        library's batched calls), which advances the matchers by the step's tokens and
        fills the bitmasks of the pending plans that are then ready. Pass what it returns
        to `finish_grammar_work` (on the driver's thread, before anything else touches
        this scheduler). None when there is nothing to do off the thread.

        While it runs, the driver may send the step's deltas on (they are final but for a
        refused token, which `finish_grammar_work` fails with a delta of its own) and
        must not plan or apply another step."""
        if not self._grammar_backlog:
            return None
        advance, self._grammar_backlog = self._grammar_backlog, []
        grammars = self.structured_outputs
        items = [(request.request_id, delta.new_token_ids) for request, delta in advance]
        fills = self._ready_deferred_bitmasks()
        self._grammar_work_out = True

        def work() -> tuple[list[tuple[Request, RequestDelta]], list[GrammarOutput]]:
            accepted = _accept_batch(grammars, items)
            refused = [pair for pair, ok in zip(advance, accepted, strict=True) if not ok]
            drop = {request.request_id for request, _ in refused}
            outputs = []
            for step_id, req_ids in fills:
                if drop:
                    req_ids = [rid for rid in req_ids if rid not in drop]
                outputs.append(GrammarOutput(step_id, req_ids,
                                             grammars.fill_bitmask(req_ids) if req_ids else b""))
            return refused, outputs

        return work

    def finish_grammar_work(self, outcome: Any) -> list[RequestDelta]:
        """Apply what a `take_grammar_work()` function returned: its GrammarOutputs join
        `take_grammar_outputs()`; a request whose token its grammar refused fails (its
        "error" delta is returned)."""
        refused, outputs = outcome
        self._grammar_work_out = False
        self._grammar_outputs.extend(outputs)
        deltas = []
        for request, delta in refused:
            if self.requests.get(request.request_id) is request:
                deltas.append(self.state.fail_request(request, _refused(request, delta)))
        return deltas

    def _fail_plan(
        self, plan: StepPlan, scheduled: dict[str, ScheduledRequest], error: str
    ) -> list[RequestDelta]:
        requests = [scheduled[req_id].request for req_id in plan.scheduled_req_ids]
        live = [r for r in requests if self.requests.get(r.request_id) is r]
        return [self.state.fail_request(r, error) for r in live]


def _accept_batch(grammars: Any, items: list) -> list[bool]:
    """`grammars.accept_tokens` of each (request id, token ids), in one
    `accept_tokens_batch` call where the manager has one."""
    batch = getattr(grammars, "accept_tokens_batch", None)
    if batch is not None:
        return batch(items)
    return [grammars.accept_tokens(rid, tokens) for rid, tokens in items]


def _drop_refused_tokens(request: Request, delta: RequestDelta) -> None:
    """Take a refused step's tokens out of the request's output and its delta (ids and
    logprobs): the errored output ends at the last token its grammar accepted, not at
    the token drawn from an all -inf row (token 0).

    NOTE: a constrained request decodes one token per step (it gets no drafts,
    core/spec_tokens.py), so the step's tokens are the refused one. Only the inline
    advance can do this: with `grammar_offload_rows` the step's deltas are sent before
    the matchers run, and the refused token has already reached the frontend."""
    num_new = len(delta.new_token_ids)
    del request.output_token_ids[len(request.output_token_ids) - num_new:]
    delta.new_token_ids = []
    delta.new_logprobs = None


def _refused(request: Request, delta: RequestDelta) -> str:
    """The error of a request whose grammar refused its sampled token. The bitmask lets
    through only tokens the grammar accepts, so the sampler drew a refused one because
    nothing was left: the request's own constraints exclude every token its grammar
    allows (min_tokens holding back an end the grammar requires, allowed_token_ids,
    bad_words or logit_bias, or a grammar that matches no text). A client error."""
    return (f"{REQUEST_ERROR_PREFIX}structured outputs: no token satisfies both the grammar "
            f"and the request's other constraints (min_tokens, allowed_token_ids, bad_words, "
            f"logit_bias) after {len(request.output_token_ids) - len(delta.new_token_ids)} "
            f"output tokens, or the grammar matches no text: token {delta.new_token_ids[-1]}, "
            f"drawn from an empty mask, does not match the grammar of request "
            f"{request.request_id}")
