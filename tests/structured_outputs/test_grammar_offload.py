"""The matchers' advance and the next bitmask's fill off the driver's thread.

- `StructuredOutputManager.accept_tokens_batch` (one batched xgrammar call for the
  one-token rows) returns what `accept_tokens` row by row returns, leaves every matcher
  in the same state (the next fills are equal), a stop token, a matcher past its end, a
  multi-token delta and a refused token included;
- `Scheduler.grammar_offload_rows`: update_from_output leaves the advance and the fill
  to `take_grammar_work()`, run here in a worker thread as the Scheduler actor does,
  and two steps in flight give exactly the tokens of the bitmask-in-the-plan run; a
  result applied before the work was finished is refused; a token the grammar refuses
  fails its request with an "error" delta of its own and leaves its row out of the next
  GrammarOutput while the others go on.
"""

from __future__ import annotations

import random
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from test_deferred_bitmask import RuleManager, _requests, allowed_tokens, model_config  # noqa: F401

from flowengine.actors import scheduler as scheduler_actor
from flowengine.config import CacheConfig, SchedulerConfig
from flowengine.core.scheduler import Scheduler
from flowengine.executor.cuda_runner import CudaModelRunner
from flowengine.executor.executor import Executor
from flowengine.executor.model_runner import ModelRunner
from flowengine.messages import StepResult
from flowengine.model.model_config import ModelConfig
from flowengine.request import Request
from flowengine.sample.sampler import Sampler
from flowengine.sampling_params import SamplingParams, StructuredOutputsParams
from flowengine.structured_outputs.manager import StructuredOutputManager

CPU = torch.device("cpu")
SCHEMA = {"type": "array", "minItems": 2, "items": {
    "type": "object", "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}},
    "required": ["id", "ok"], "additionalProperties": False}}


def _manager(tokenizer, vocab_size, ids):
    manager = StructuredOutputManager("xgrammar", vocab_size=vocab_size, tokenizer=tokenizer)
    for rid in ids:
        # r1: a short regex, so that it may end (EOS) within the test's steps.
        so = (StructuredOutputsParams(regex="[ab]{1,4}") if rid == "r1"
              else StructuredOutputsParams(json=SCHEMA))
        r = Request(rid, [1, 2], SamplingParams(max_tokens=64, structured_outputs=so),
                    eos_token_id=tokenizer.eos_token_id, max_tokens=64)
        manager.add_request(r)
        while (status := manager.poll(r)) == "compiling":
            manager.wait_for_compiles(5.0)
        assert status is None, status
    return manager


def _allowed(manager, rid) -> list[int]:
    words = np.frombuffer(manager.fill_bitmask([rid]), dtype=np.uint8)
    bits = np.unpackbits(words, bitorder="little")[:manager.vocab_size]
    return np.flatnonzero(bits).tolist()


def test_batched_accepts_equal_row_by_row(tokenizer, vocab_size):
    ids = [f"r{i}" for i in range(6)]
    batched, single = (_manager(tokenizer, vocab_size, ids) for _ in range(2))
    eos = tokenizer.eos_token_id
    rng = random.Random(0)
    ended_at = {"r1": 2}  # r1 ends (EOS allowed there or later), then takes EOS only
    for step in range(40):
        items = []
        for rid in ids:
            allowed = _allowed(single, rid)
            if rid in single._ended:
                tokens = [eos] if step % 2 else [eos, eos]
            elif eos in allowed and step >= ended_at.get(rid, 99):
                tokens = [eos]
            elif rid == "r2" and step == 5:
                tokens = [rng.choice(allowed), 13]  # the second token is likely refused
            elif rid == "r3" and step == 7:
                tokens = [next(t for t in range(vocab_size) if t not in allowed)]  # refused
            else:
                tokens = [rng.choice([t for t in allowed if t != eos])]
            items.append((rid, tokens))
        expected = [single.accept_tokens(rid, tokens) for rid, tokens in items]
        assert batched.accept_tokens_batch(items) == expected, step
        live = [rid for rid, _ in items if rid in single._matchers]
        assert batched.fill_bitmask(live) == single.fill_bitmask(live), step
        for (rid, _), ok in zip(items, expected, strict=True):
            if not ok:  # the scheduler fails the request: both forget it
                single.remove(rid)
                batched.remove(rid)
                ids.remove(rid)
    assert "r3" not in ids and "r1" in single._ended and "r1" in batched._ended
    batched.shutdown()
    single.shutdown()


def _scheduler(manager) -> Scheduler:
    scheduler = Scheduler(SchedulerConfig(8, 64, 96), CacheConfig(4, 60), async_scheduling=True,
                          structured_output_manager=manager, defer_grammar_bitmask=True)
    scheduler.grammar_offload_rows = 1
    for msg in _requests():
        scheduler.add_request(Request.from_new_request(msg, 96))
    return scheduler


def _generate_offloaded(executor: Executor, manager) -> tuple[dict, list]:
    """The Scheduler actor's loop with two steps in flight and the grammar work in a
    worker thread, synchronously otherwise."""
    scheduler = _scheduler(manager)
    pool = ThreadPoolExecutor(1)
    tokens: dict[str, list[int]] = {}
    errors: dict[str, str] = {}
    outputs = []
    in_flight: deque = deque()  # [plan, forward or None, handle or None]

    def sample(grammars):
        for grammar in grammars:
            outputs.append(grammar)
            entry = next(e for e in in_flight if e[0].step_id == grammar.step_id)
            assert entry[2] is None
            entry[2] = executor.launch_sampling(entry[1], grammar)

    while scheduler.has_unfinished_requests() or in_flight:
        while len(in_flight) < 2:
            plan = scheduler.schedule()
            if not plan.num_scheduled_tokens:
                break
            if plan.pending_structured_output_tokens:
                in_flight.append([plan, executor.launch_forward(plan), None])
                sample(scheduler.fill_grammar_bitmasks())
            else:
                in_flight.append([plan, None, executor.launch(plan)])
        plan, _, handle = in_flight.popleft()
        deltas = scheduler.update_from_output(plan, handle.result())
        work = scheduler.take_grammar_work()
        if work is not None:
            future = pool.submit(work)
            if in_flight:  # nothing may be applied while the work runs
                with pytest.raises(ValueError, match="before the grammar work"):
                    scheduler.update_from_output(in_flight[0][0],
                                                 StepResult(in_flight[0][0].step_id, []))
            deltas += scheduler.finish_grammar_work(future.result())
        for delta in deltas:
            tokens.setdefault(delta.req_id, []).extend(delta.new_token_ids)
            if delta.error is not None:
                errors[delta.req_id] = delta.error
        sample(scheduler.take_grammar_outputs())
        assert not in_flight or in_flight[0][2] is not None
    pool.shutdown()
    return tokens, errors, outputs


def _runner(config, cls):
    return cls(config, CacheConfig(4, 60), CPU, torch.float32,
               max_num_batched_tokens=64, max_num_seqs=8)


def test_offloaded_grammar_work_gives_the_same_tokens(
        model_config: ModelConfig) -> None:  # noqa: F811 - the fixture of test_deferred_bitmask
    # The reference: bitmasks in the plans, one step at a time.
    scheduler = Scheduler(SchedulerConfig(8, 64, 96), CacheConfig(4, 60),
                          structured_output_manager=RuleManager())
    for msg in _requests():
        scheduler.add_request(Request.from_new_request(msg, 96))
    executor = Executor(_runner(model_config, ModelRunner), Sampler(seed=1))
    expected: dict[str, list[int]] = {}
    while scheduler.has_unfinished_requests():
        plan = scheduler.schedule()
        for delta in scheduler.update_from_output(plan, executor.execute_model(plan)):
            expected.setdefault(delta.req_id, []).extend(delta.new_token_ids)
    assert {rid: len(t) for rid, t in expected.items()} == {"0": 9, "1": 12, "2": 7, "3": 10}

    for cls in (CudaModelRunner, ModelRunner):
        tokens, errors, outputs = _generate_offloaded(
            Executor(_runner(model_config, cls), Sampler(seed=1)), RuleManager())
        assert tokens == expected and not errors, cls.__name__
        assert len(outputs) >= 9 and all(o.grammar_bitmask for o in outputs)
        for rid in ("0", "2", "3"):
            for i, t in enumerate(tokens[rid]):
                assert t in allowed_tokens(tokens[rid][:i]), (rid, i)


class _RefusingManager(RuleManager):
    """Refuses request "0"'s third token (a grammar library that disagrees with its own
    mask); everything else as RuleManager."""

    def accept_tokens(self, request_id, token_ids):
        history = self.history.get(request_id)
        if request_id == "0" and history is not None and len(history) == 2:
            return False
        return super().accept_tokens(request_id, token_ids)


def test_a_refused_token_fails_only_its_request(model_config: ModelConfig) -> None:  # noqa: F811
    tokens, errors, outputs = _generate_offloaded(
        Executor(_runner(model_config, ModelRunner), Sampler(seed=1)), _RefusingManager())
    assert set(errors) == {"0"} and "does not match the grammar" in errors["0"]
    assert len(tokens["0"]) == 3  # its third token was delivered, then the error
    assert {rid: len(tokens[rid]) for rid in ("1", "2", "3")} == {"1": 12, "2": 7, "3": 10}
    # The GrammarOutputs after the refusal have no row for it.
    rows = [o.structured_output_req_ids for o in outputs]
    first = next(i for i, r in enumerate(rows) if "0" not in r)
    assert all("0" not in r for r in rows[first:]) and any("2" in r for r in rows[first:])


def test_offload_rows_setting(monkeypatch):
    monkeypatch.delenv("FLOWENGINE_GRAMMAR_OFFLOAD_ROWS", raising=False)
    assert scheduler_actor.grammar_offload_rows() == scheduler_actor.GRAMMAR_OFFLOAD_ROWS
    # The engine process's default: inline unless the variable is set.
    assert scheduler_actor.grammar_offload_rows(None) is None
    monkeypatch.setenv("FLOWENGINE_GRAMMAR_OFFLOAD_ROWS", "0")
    assert scheduler_actor.grammar_offload_rows() is None
    monkeypatch.setenv("FLOWENGINE_GRAMMAR_OFFLOAD_ROWS", "48")
    assert scheduler_actor.grammar_offload_rows(None) == 48
    monkeypatch.setenv("FLOWENGINE_GRAMMAR_OFFLOAD_ROWS", "-1")
    with pytest.raises(ValueError, match="FLOWENGINE_GRAMMAR_OFFLOAD_ROWS"):
        scheduler_actor.grammar_offload_rows()
