"""A deterministic stand-in for the executor, and a loop that drives a Scheduler with it.

`SimExecutor` keeps per-request state only from what StepPlans tell it, exactly like a
real executor (the contract in `StepPlan`'s docstring): `new_reqs` in full,
`cached_reqs` as deltas, `finished_req_ids` dropped, and it appends the token it
samples to its own copy of a request whose tokens are all computed, before the next
plan. So with async scheduling, step N+1 reads the token step N sampled from the
executor's copy, never from the scheduler. It "computes" a KV cache: the value stored in the slot of position p
is mix(value at p-1, token p), read back through the block table. The next token is
derived from the value at the last position. So a wrong block table, a prefix-cache
hit on a block holding other tokens, or a read of a slot never written changes the
output (or raises), and outputs depend only on the token history otherwise.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from flowengine.config import CacheConfig, SchedulerConfig
from flowengine.core.scheduler import Scheduler
from flowengine.messages import RequestDelta, SampledTokens, StepPlan, StepResult
from flowengine.request import Request, RequestStatus
from flowengine.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1
_ROOT_KV = 0x51ED270B27A3D1C5


def mix(a: int, b: int) -> int:
    """A 64-bit mixing function (splitmix64 finaliser over a ^ b-derived input)."""
    z = (a ^ ((b + 0x9E3779B97F4A7C15) * 0xBF58476D1CE4E5B9)) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


@dataclass
class _ExecRequest:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class SimExecutor:
    """Executor stand-in over `num_blocks` blocks of `block_size` slots, vocab `vocab_size`."""

    num_blocks: int
    block_size: int
    vocab_size: int
    kv: list[int | None] = field(init=False)
    requests: dict[str, _ExecRequest] = field(default_factory=dict)
    num_computed_total: int = 0
    # Blocks whose slots the last `execute` wrote.
    written_block_ids: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.kv = [None] * (self.num_blocks * self.block_size)

    def _slot(self, state: _ExecRequest, position: int) -> int:
        return state.block_ids[position // self.block_size] * self.block_size + (
            position % self.block_size
        )

    def _read(self, state: _ExecRequest, position: int) -> int:
        value = self.kv[self._slot(state, position)]
        assert value is not None, f"read of a KV slot never written (position {position})"
        return value

    def execute(self, plan: StepPlan) -> StepResult:
        for req_id in plan.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in plan.new_reqs:
            assert new.req_id not in self.requests, f"{new.req_id} sent in full twice"
            self.requests[new.req_id] = _ExecRequest(
                list(new.token_ids), list(new.block_ids), new.num_computed_tokens
            )
        for cached in plan.cached_reqs:
            state = self.requests[cached.req_id]
            assert state.num_computed_tokens == cached.num_computed_tokens, cached
            state.block_ids.extend(cached.new_block_ids)
        sampled = []
        self.written_block_ids = set()
        for req_id, num_tokens in zip(
            plan.scheduled_req_ids, plan.num_scheduled_tokens, strict=True
        ):
            state = self.requests[req_id]
            start = state.num_computed_tokens
            assert num_tokens >= 1 and start + num_tokens <= len(state.token_ids)
            assert len(state.block_ids) * self.block_size >= start + num_tokens
            for pos in range(start, start + num_tokens):
                prev = self._read(state, pos - 1) if pos > 0 else _ROOT_KV
                self.kv[self._slot(state, pos)] = mix(prev, state.token_ids[pos])
                self.written_block_ids.add(state.block_ids[pos // self.block_size])
            state.num_computed_tokens += num_tokens
            self.num_computed_total += num_tokens
            if state.num_computed_tokens == len(state.token_ids):
                last = self._read(state, state.num_computed_tokens - 1)
                token_id = (mix(last, 7) >> 11) % self.vocab_size
                state.token_ids.append(token_id)
                sampled.append(SampledTokens(req_id, [token_id]))
        return StepResult(plan.step_id, sampled)


@dataclass
class Finished:
    """What a caller saw of one request: all its tokens and how it ended."""

    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None


def make_scheduler(
    *,
    num_blocks: int = 64,
    block_size: int = 16,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
    max_model_len: int = 1024,
    enable_chunked_prefill: bool = True,
    enable_prefix_caching: bool = True,
    policy: str = "fcfs",
    async_scheduling: bool = False,
    structured_output_manager: object = None,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=enable_chunked_prefill,
            policy=policy,  # type: ignore[arg-type]
        ),
        CacheConfig(block_size, num_blocks, enable_prefix_caching),
        async_scheduling=async_scheduling,
        structured_output_manager=structured_output_manager,
    )


def make_request(
    request_id: str,
    prompt: list[int],
    *,
    max_tokens: int = 16,
    eos_token_id: int | None = None,
    arrival_time: float = 0.0,
    priority: int = 0,
    cache_salt: str | None = None,
    **params: object,
) -> Request:
    return Request(
        request_id,
        prompt,
        SamplingParams(max_tokens=max_tokens, **params),  # type: ignore[arg-type]
        eos_token_id=eos_token_id,
        max_tokens=max_tokens,
        arrival_time=arrival_time,
        priority=priority,
        cache_salt=cache_salt,
    )


def executor_for(scheduler: Scheduler, vocab_size: int = 50) -> SimExecutor:
    cache = scheduler.cache_config
    return SimExecutor(cache.num_blocks, cache.block_size, vocab_size)


def collect(deltas: list[RequestDelta], outputs: dict[str, Finished]) -> None:
    for delta in deltas:
        out = outputs.setdefault(delta.req_id, Finished([]))
        assert out.finish_reason is None, f"{delta.req_id} got output after finishing"
        out.token_ids.extend(delta.new_token_ids)
        out.finish_reason = delta.finish_reason
        out.stop_reason = delta.stop_reason
        out.num_cached_tokens = delta.num_cached_tokens
        out.error = delta.error


@dataclass
class SimStats:
    """What `run_to_completion` saw.

    num_decode_overlaps: (request, plan) pairs where the request was scheduled in a plan
        made while the plan in which it samples was still in flight (decode overlap).
    num_preempted_in_flight: preemptions made while a plan was in flight.
    """

    num_steps: int = 0
    num_decode_overlaps: int = 0
    num_preempted_in_flight: int = 0


def _check_no_reuse_in_flight(plan: StepPlan, written_in_flight: set[int]) -> None:
    """Blocks a plan hands out must not be written by any step still in flight."""
    given = [b for r in plan.new_reqs for b in r.block_ids]
    given += [b for r in plan.cached_reqs for b in r.new_block_ids]
    reused = written_in_flight.intersection(given)
    assert not reused, f"step {plan.step_id} reuses blocks {reused} written by steps in flight"


def run_to_completion(
    scheduler: Scheduler,
    executor: SimExecutor,
    arrivals: dict[int, list[Request]],
    max_steps: int = 20_000,
    max_in_flight: int = 1,
    aborts: dict[int, list[str]] | None = None,
    stats: SimStats | None = None,
) -> dict[str, Finished]:
    """Add requests at their step (arrivals[step]), step until all finish, return outputs.

    With `max_in_flight` 2 the next plan is made before the previous result is applied
    (the overlapped engine loop). `aborts[step]` are aborted at that step, while a plan
    may be in flight (they end with finish_reason "abort" if still live). Checks on the
    way: the token budget and seat limit hold every step, no block written by a step in
    flight is handed out, no output follows a finish, progress never stalls, and at the
    end every block is free and the executor holds no state.
    """
    outputs: dict[str, Finished] = {}
    stats = SimStats() if stats is None else stats
    aborts = aborts or {}
    config = scheduler.config
    in_flight: deque[tuple[StepPlan, StepResult, set[int]]] = deque()
    step = 0
    last_event = max([*arrivals, *aborts], default=0)
    while step <= last_event or scheduler.has_unfinished_requests() or in_flight:
        assert step < max_steps, "no progress"
        for request in arrivals.get(step, []):
            scheduler.add_request(request)
        for req_id in aborts.get(step, []):
            if scheduler.get_request(req_id) is not None:
                scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)
                outputs.setdefault(req_id, Finished([])).finish_reason = "abort"
        while len(in_flight) < max_in_flight:
            num_preemptions = scheduler.num_preemptions
            plan = scheduler.schedule()
            assert plan.total_num_scheduled_tokens <= config.max_num_batched_tokens
            assert len(plan.num_scheduled_tokens) <= config.max_num_seqs
            assert scheduler.num_running <= config.max_num_seqs
            if in_flight:
                stats.num_preempted_in_flight += scheduler.num_preemptions - num_preemptions
                _check_no_reuse_in_flight(plan, set().union(*(w for _, _, w in in_flight)))
                sampling = {s.req_id for s in in_flight[-1][1].sampled}
                stats.num_decode_overlaps += len(sampling.intersection(plan.scheduled_req_ids))
            if not plan.num_scheduled_tokens:
                break
            result = executor.execute(plan)
            in_flight.append((plan, result, executor.written_block_ids))
            stats.num_steps += 1
        if in_flight:
            plan, result, _ = in_flight.popleft()
            collect(scheduler.update_from_output(plan, result), outputs)
        else:
            assert not scheduler.num_running and not scheduler.num_waiting
        step += 1
    # One more plan delivers the last finished ids to the executor.
    executor.execute(scheduler.schedule())
    assert executor.requests == {}
    assert scheduler.num_steps_in_flight == 0
    assert scheduler.num_free_blocks == scheduler.num_total_blocks
    return outputs
