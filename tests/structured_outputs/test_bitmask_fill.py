"""The batched bitmask fill and the deferred fill of every constrained plan.

- `StructuredOutputManager.fill_bitmask` (rows kept per matcher, one batched call per
  backend, threads from PARALLEL_FILL_ROWS rows) gives exactly the rows each matcher
  fills by itself, in any order of ids, and recomputes only rows whose matcher changed;
- `Scheduler(defer_grammar_bitmask=True)`: every plan with constrained rows goes out
  without its bitmask, `fill_grammar_bitmasks()` after the forward was launched gives
  its GrammarOutput, and the tokens equal the run with the bitmask in the plan (one and
  two steps in flight); `EngineCore.step` takes that path with a real executor.
"""

from __future__ import annotations

from collections import deque

import pytest
import torch
from test_deferred_bitmask import RuleManager, _requests, allowed_tokens, model_config  # noqa: F401

from flowengine.config import CacheConfig, SchedulerConfig
from flowengine.core.scheduler import Scheduler
from flowengine.engine.engine_core import EngineCore
from flowengine.executor.cuda_runner import CudaModelRunner
from flowengine.executor.executor import Executor
from flowengine.executor.model_runner import ModelRunner
from flowengine.model.model_config import ModelConfig
from flowengine.request import Request
from flowengine.sample.sampler import Sampler
from flowengine.sampling_params import SamplingParams, StructuredOutputsParams
from flowengine.structured_outputs import manager as manager_module
from flowengine.structured_outputs.manager import StructuredOutputManager

CPU = torch.device("cpu")


def _request(rid: str, so: StructuredOutputsParams, eos: int) -> Request:
    return Request(rid, [1, 2], SamplingParams(max_tokens=32, structured_outputs=so),
                   eos_token_id=eos, max_tokens=32)


def _reference_rows(manager: StructuredOutputManager, ids: list[str]) -> bytes:
    """Each matcher filling its own row of a fresh tensor (stop tokens only past the end)."""
    bitmask = torch.zeros(len(ids), manager.num_words, dtype=torch.int32)
    for row, rid in enumerate(ids):
        matcher = manager._matchers[rid]
        if matcher.is_terminated():
            for t in manager._stop_ids[rid]:
                bitmask[row, t // 32] |= (1 << (t % 32)) - (1 << 32 if t % 32 == 31 else 0)
        else:
            matcher.fill_bitmask(bitmask, row)
    return bitmask.numpy().tobytes()


@pytest.mark.parametrize("fill_threads", [1, 2])
def test_batched_fill_equals_each_matchers_row_and_reuses_unchanged_rows(
        tokenizer, vocab_size, monkeypatch, fill_threads):
    monkeypatch.setattr(manager_module, "PARALLEL_FILL_ROWS", 2)  # threads from 2 rows
    eos = tokenizer.eos_token_id
    manager = StructuredOutputManager("auto", vocab_size=vocab_size, tokenizer=tokenizer,
                                      fill_threads=fill_threads)
    specs = [StructuredOutputsParams(regex="[a-c]{2,5}"),
             StructuredOutputsParams(choice=["abc", "acb", "b"]),
             # Length bounds beside a format send these schemas to llguidance ("auto").
             StructuredOutputsParams(json={"type": "string", "format": "date",
                                           "maxLength": 12}),
             StructuredOutputsParams(json={"type": "string", "format": "date",
                                           "minLength": 10}),
             StructuredOutputsParams(regex="a"),
             StructuredOutputsParams(regex="[a-c]{2,5}")]
    ids = [f"r{i}" for i in range(len(specs))]
    for rid, so in zip(ids, specs, strict=True):
        r = _request(rid, so, eos)
        manager.add_request(r)
        while (status := manager.poll(r)) == "compiling":
            manager.wait_for_compiles(5.0)
        assert status is None and manager.has_matcher(rid), status
    a, b, c = (tokenizer.encode(x, add_special_tokens=False)[0] for x in "abc")
    quote = tokenizer.encode('"', add_special_tokens=False)[0]
    assert manager.accept_tokens("r4", [a, eos])  # r4 is past its end: EOS only
    assert manager.accept_tokens("r2", [quote]) and manager.accept_tokens("r3", [quote])
    assert manager.fill_bitmask(ids) == _reference_rows(manager, ids)
    assert manager.num_rows_filled == len(ids)
    # Nothing changed: every row comes from the buffer, in any order of the ids.
    shuffled = [ids[i] for i in (3, 0, 5, 1, 4, 2)]
    assert manager.fill_bitmask(shuffled) == _reference_rows(manager, shuffled)
    assert manager.fill_bitmask(ids[1:3]) == _reference_rows(manager, ids[1:3])
    assert manager.num_rows_filled == len(ids)
    # One token each for r0, r1, r5 (and EOS again for r4): only those rows are refilled.
    for rid, tok in (("r0", a), ("r1", a), ("r5", c), ("r4", eos)):
        assert manager.accept_tokens(rid, [tok])
    assert manager.fill_bitmask(shuffled) == _reference_rows(manager, shuffled)
    assert manager.num_rows_filled == len(ids) + 4
    # A removed request's slot is reused by the next matcher, whose row is filled fresh.
    manager.remove("r5")
    late = _request("r6", StructuredOutputsParams(choice=["b"]), eos)
    manager.add_request(late)
    while manager.poll(late) == "compiling":
        manager.wait_for_compiles(5.0)
    ids = ["r6", *ids[:5]]
    assert manager.fill_bitmask(ids) == _reference_rows(manager, ids)
    allowed_r6 = torch.frombuffer(bytearray(manager.fill_bitmask(["r6"])), dtype=torch.int32)
    assert (int(allowed_r6[b // 32]) >> (b % 32)) & 1 == 1
    assert (int(allowed_r6[a // 32]) >> (a % 32)) & 1 == 0
    manager.shutdown()


def test_fill_threads_are_checked(tokenizer, vocab_size, monkeypatch):
    with pytest.raises(ValueError, match="fill_threads must be >= 1"):
        StructuredOutputManager("auto", vocab_size=vocab_size, tokenizer=tokenizer,
                                fill_threads=0)
    monkeypatch.setenv("FLOWENGINE_GRAMMAR_FILL_THREADS", "3")
    assert manager_module.default_fill_threads() == 3
    monkeypatch.setenv("FLOWENGINE_GRAMMAR_FILL_THREADS", "0")
    with pytest.raises(ValueError, match="FLOWENGINE_GRAMMAR_FILL_THREADS"):
        manager_module.default_fill_threads()


def _generate_deferred(executor: Executor, max_in_flight: int):
    """The scheduler actor's loop with defer_grammar_bitmask, synchronously: each plan
    with constrained rows goes out pending, its forward is launched, then
    fill_grammar_bitmasks() (right away, or after the previous result) and sampling."""
    manager = RuleManager()
    scheduler = Scheduler(SchedulerConfig(8, 64, 96), CacheConfig(4, 60),
                          async_scheduling=max_in_flight > 1, structured_output_manager=manager,
                          defer_grammar_bitmask=True)
    for msg in _requests():
        scheduler.add_request(Request.from_new_request(msg, 96))
    tokens: dict[str, list[int]] = {}
    plans = []
    in_flight: deque = deque()  # [plan, forward or None, handle or None]

    def sample(grammars):
        for grammar in grammars:
            entry = next(e for e in in_flight if e[0].step_id == grammar.step_id)
            assert entry[2] is None and grammar.structured_output_req_ids
            entry[2] = executor.launch_sampling(entry[1], grammar)

    while scheduler.has_unfinished_requests() or in_flight:
        while len(in_flight) < max_in_flight:
            plan = scheduler.schedule()
            if not plan.num_scheduled_tokens:
                break
            plans.append(plan)
            assert plan.grammar_bitmask == b""  # never in the plan
            if plan.pending_structured_output_tokens:
                in_flight.append([plan, executor.launch_forward(plan), None])
                sample(scheduler.fill_grammar_bitmasks())
                if max_in_flight == 1:  # nothing before it in flight: filled at once
                    assert in_flight[-1][2] is not None
            else:
                in_flight.append([plan, None, executor.launch(plan)])
        plan, _, handle = in_flight.popleft()
        for delta in scheduler.update_from_output(plan, handle.result()):
            assert delta.error is None, delta.error
            tokens.setdefault(delta.req_id, []).extend(delta.new_token_ids)
        sample(scheduler.take_grammar_outputs())
        assert not in_flight or in_flight[0][2] is not None
    return tokens, plans


def test_deferred_fill_of_every_constrained_plan_gives_the_same_tokens(
        model_config: ModelConfig) -> None:  # noqa: F811 - the fixture of test_deferred_bitmask
    def runner(cls):
        return cls(model_config, CacheConfig(4, 60), CPU, torch.float32,
                   max_num_batched_tokens=64, max_num_seqs=8)

    # The reference: bitmasks in the plans, one step at a time (test_deferred_bitmask).
    manager = RuleManager()
    scheduler = Scheduler(SchedulerConfig(8, 64, 96), CacheConfig(4, 60),
                          structured_output_manager=manager)
    for msg in _requests():
        scheduler.add_request(Request.from_new_request(msg, 96))
    core = EngineCore(scheduler, _PlanOnly(Executor(runner(ModelRunner), Sampler(seed=1))), 96)
    expected: dict[str, list[int]] = {}
    while scheduler.has_unfinished_requests():
        for delta in core.step():
            expected.setdefault(delta.req_id, []).extend(delta.new_token_ids)
    assert {rid: len(t) for rid, t in expected.items()} == {"0": 9, "1": 12, "2": 7, "3": 10}
    for rid in ("0", "2", "3"):
        for i, t in enumerate(expected[rid]):
            assert t in allowed_tokens(expected[rid][:i]), (rid, i)

    for cls, in_flight in ((ModelRunner, 1), (CudaModelRunner, 2), (ModelRunner, 2)):
        tokens, plans = _generate_deferred(Executor(runner(cls), Sampler(seed=1)), in_flight)
        assert tokens == expected, (cls.__name__, in_flight)
        # Every plan with a constrained sampling row was sent pending.
        assert all(p.pending_structured_output_tokens == bool(
            {"0", "2", "3"} & set(p.scheduled_req_ids)) for p in plans)

    # EngineCore.step with a splittable executor defers by itself.
    manager = RuleManager()
    scheduler = Scheduler(SchedulerConfig(8, 64, 96), CacheConfig(4, 60),
                          structured_output_manager=manager)
    for msg in _requests():
        scheduler.add_request(Request.from_new_request(msg, 96))
    core = EngineCore(scheduler, Executor(runner(ModelRunner), Sampler(seed=1)), 96)
    assert scheduler.defer_grammar_bitmask
    got: dict[str, list[int]] = {}
    while scheduler.has_unfinished_requests():
        for delta in core.step():
            got.setdefault(delta.req_id, []).extend(delta.new_token_ids)
    assert got == expected


class _PlanOnly:
    """An executor with execute_model only: EngineCore keeps the bitmask in the plan."""

    def __init__(self, executor: Executor) -> None:
        self._executor = executor

    def execute_model(self, plan):
        assert not plan.pending_structured_output_tokens
        return self._executor.execute_model(plan)
