"""Test helper: drive an EngineCore's scheduler with several plans in flight.

The Scheduler actor's loop in miniature, for pipeline-parallel tests that run every
stage in one process (tests/distributed/test_pp_local.py on the CPU,
tests/gpu/test_pp_gpu.py on one GPU): up to `max_in_flight` plans are launched
before the oldest one's result is read, so two micro-batches overlap as in a real
pipeline.
"""

from __future__ import annotations

from collections import deque

from flowengine.engine.engine_core import EngineCore
from flowengine.messages import NewRequest
from flowengine.sampling_params import SamplingParams


def generate_in_flight(core: EngineCore, executor, prompt_ids: list[list[int]],
                       params: SamplingParams,
                       max_in_flight: int) -> tuple[list[list[int]], dict[str, int]]:
    """Greedy ids of `prompt_ids` (one list per prompt, in order) and counters of what
    the run exercised: max_in_flight (plans launched at once), partial_prefills
    (chunked-prefill steps), cached_tokens (prefix-cache hits).

    `executor` has `launch(plan) -> handle` with `handle.result()`: an Executor or a
    LocalPipeline. Raises AssertionError when a step returns an error or nothing can
    be scheduled while requests remain."""
    scheduler = core.scheduler
    for i, p in enumerate(prompt_ids):
        core.add_request(NewRequest(f"r{i}", p, params, 0.0))
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompt_ids))}
    seen = {"max_in_flight": 0, "partial_prefills": 0, "cached_tokens": 0}
    in_flight: deque = deque()
    while scheduler.has_unfinished_requests() or in_flight:
        while len(in_flight) < max_in_flight:
            plan = scheduler.schedule()
            if not plan.num_scheduled_tokens:
                break
            for new, num in zip(plan.new_reqs, plan.num_scheduled_tokens, strict=False):
                if new.num_computed_tokens + num < new.num_prompt_tokens:
                    seen["partial_prefills"] += 1
            in_flight.append((plan, executor.launch(plan)))
        seen["max_in_flight"] = max(seen["max_in_flight"], len(in_flight))
        assert in_flight, "unfinished requests but nothing schedulable"
        plan, handle = in_flight.popleft()
        result = handle.result()
        assert result.error is None, result.error
        for delta in scheduler.update_from_output(plan, result):
            outputs[delta.req_id].extend(delta.new_token_ids)
            seen["cached_tokens"] += delta.num_cached_tokens
    return [outputs[f"r{i}"] for i in range(len(prompt_ids))], seen
