"""The scheduler with structured outputs: grammar wait, bitmask per plan, matchers.

Driven with a stand-in executor that follows the StepPlan contract (its own copy of
each request's tokens, appended as it samples, so with async scheduling step N+1 runs
on the token of step N) and samples a constrained request only from its bitmask row
(the plan's, or, for a plan with pending_structured_output_tokens, its GrammarOutput's,
which the scheduler fills after the result before it): a deterministic pick among the
allowed tokens, from a hash of the token history, so the same history gives the same
token in every mode.
"""

from __future__ import annotations

import json
import re
from collections import deque
from concurrent.futures import Future

import pytest
import torch
from core_sim_executor import Finished, collect, make_scheduler

from flowengine.messages import (
    GrammarOutput,
    SampledTokens,
    StepPlan,
    StepResult,
    is_request_error,
)
from flowengine.request import Request, RequestStatus
from flowengine.sampling_params import SamplingParams, StructuredOutputsParams
from flowengine.structured_outputs.manager import StructuredOutputManager

REGEX = r"[a-d]{2,6}-[0-9]{1,3}"
CHOICES = ["alpha", "beta", "gamma delta"]
SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 999},
    "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["x", "yy", "zzz"]}}},
    "required": ["id", "tags"], "additionalProperties": False}


def _mix(values: list[int]) -> int:
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = ((h ^ v) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
        h ^= h >> 29
    return h


class GrammarSimExecutor:
    """Samples allowed tokens only; `force` maps req id -> a token to return instead
    (to test a token the grammar refuses)."""

    def __init__(self, vocab_size: int, unconstrained_vocab: int = 5000) -> None:
        self.vocab_size = vocab_size
        self.unconstrained_vocab = unconstrained_vocab
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.force: dict[str, int] = {}
        self.num_masked_rows = 0

    def execute(self, plan: StepPlan, grammar: GrammarOutput | None = None) -> StepResult:
        assert plan.pending_structured_output_tokens == (grammar is not None)
        source = plan if grammar is None else grammar
        assert source.step_id == plan.step_id
        for rid in plan.finished_req_ids:
            self.tokens.pop(rid, None)
        for new in plan.new_reqs:
            self.tokens[new.req_id] = list(new.token_ids)
            self.computed[new.req_id] = new.num_computed_tokens
        masks = {}
        if source.structured_output_req_ids:
            words = torch.frombuffer(bytearray(source.grammar_bitmask),
                                     dtype=torch.int32).view(
                len(source.structured_output_req_ids), -1)
            bits = ((words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).view(
                len(source.structured_output_req_ids), -1)[:, :self.vocab_size]
            masks = {rid: torch.nonzero(bits[k]).flatten().tolist()
                     for k, rid in enumerate(source.structured_output_req_ids)}
        sampled = []
        for rid, n in zip(plan.scheduled_req_ids, plan.num_scheduled_tokens, strict=True):
            tokens = self.tokens[rid]
            self.computed[rid] += n
            assert self.computed[rid] <= len(tokens)
            if self.computed[rid] < len(tokens):
                assert rid not in masks  # a partial prefill chunk samples nothing
                continue
            h = _mix(tokens)
            if rid in masks:
                self.num_masked_rows += 1
                token = masks[rid][h % len(masks[rid])]
            else:
                token = h % self.unconstrained_vocab
            token = self.force.pop(rid, token)
            tokens.append(token)
            sampled.append(SampledTokens(rid, [token]))
        return StepResult(plan.step_id, sampled)


def run(scheduler, executor, max_in_flight: int = 1, on_plan=None,
        on_grammar=None) -> dict[str, Finished]:
    """Drive the scheduler as the actors do: up to `max_in_flight` plans in flight; a
    pending plan (pending_structured_output_tokens) is executed only with its
    GrammarOutput, which the scheduler hands out after the result before it."""
    outputs: dict[str, Finished] = {}
    in_flight: deque = deque()  # [plan, result or None while its bitmask is pending]
    manager = scheduler.structured_outputs
    for _ in range(10_000):
        if not scheduler.has_unfinished_requests() and not in_flight:
            return outputs
        while len(in_flight) < max_in_flight:
            plan = scheduler.schedule()
            collect(scheduler.pending_deltas, outputs)
            scheduler.pending_deltas.clear()
            if not plan.num_scheduled_tokens:
                break
            if on_plan is not None:
                on_plan(plan)
            pending = plan.pending_structured_output_tokens
            in_flight.append([plan, None if pending else executor.execute(plan)])
        if not in_flight:
            manager.wait_for_compiles(5.0)
            continue
        plan, result = in_flight.popleft()
        assert result is not None  # a pending plan's bitmask comes before its result
        collect(scheduler.update_from_output(plan, result), outputs)
        for grammar in scheduler.take_grammar_outputs():
            entry = in_flight[0]  # the bitmask of the oldest step in flight, in order
            assert entry[0].step_id == grammar.step_id and entry[1] is None
            if on_grammar is not None:
                on_grammar(grammar)
            entry[1] = executor.execute(entry[0], grammar)
        assert not in_flight or in_flight[0][1] is not None
    raise AssertionError("did not finish")


@pytest.fixture(scope="module")
def vocab_size(default_model_path: str) -> int:
    from flowengine.model.model_config import ModelConfig

    return ModelConfig.from_pretrained(default_model_path).vocab_size


@pytest.fixture
def manager(tokenizer, vocab_size):
    m = StructuredOutputManager("auto", vocab_size=vocab_size, tokenizer=tokenizer)
    yield m
    m.shutdown()


def _req(req_id: str, tokenizer, so: StructuredOutputsParams | None, max_tokens: int = 48,
         prompt_len: int = 20) -> Request:
    return Request(req_id, list(range(100, 100 + prompt_len)),
                   SamplingParams(max_tokens=max_tokens, structured_outputs=so),
                   eos_token_id=tokenizer.eos_token_id, max_tokens=max_tokens)


def _requests(tokenizer) -> list[Request]:
    return [
        _req("re", tokenizer, StructuredOutputsParams(regex=REGEX)),
        _req("free0", tokenizer, None, max_tokens=12),
        _req("choice", tokenizer, StructuredOutputsParams(choice=CHOICES)),
        _req("json", tokenizer, StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
             max_tokens=64),
        _req("free1", tokenizer, None, max_tokens=20, prompt_len=40),
    ]


def _check_valid(outputs: dict[str, Finished], tokenizer) -> None:
    text = {rid: tokenizer.decode(o.token_ids, skip_special_tokens=True)
            for rid, o in outputs.items()}
    for rid in ("re", "choice", "json"):
        assert outputs[rid].finish_reason == "stop", (rid, outputs[rid], text[rid])
        assert outputs[rid].token_ids[-1] == tokenizer.eos_token_id
    assert re.fullmatch(REGEX, text["re"]), text["re"]
    assert text["choice"] in CHOICES
    instance = json.loads(text["json"])
    assert set(instance) == {"id", "tags"} and 0 <= instance["id"] <= 999
    assert len(instance["tags"]) <= 3 and set(instance["tags"]) <= {"x", "yy", "zzz"}
    assert outputs["free0"].finish_reason == "length" and len(outputs["free0"].token_ids) == 12


def test_constrained_requests_in_every_scheduling_mode(manager, tokenizer, vocab_size):
    results = {}
    for mode, kwargs, in_flight in [
        ("sync", {}, 1),
        ("async", {"async_scheduling": True}, 2),
        # Few blocks: requests are preempted and recomputed; matchers keep their state.
        ("preempt", {"num_blocks": 10, "block_size": 4}, 1),
        ("preempt-async", {"num_blocks": 10, "block_size": 4, "async_scheduling": True}, 2),
        # A small budget splits prompts into chunks that sample nothing.
        ("chunked", {"max_num_batched_tokens": 8}, 1),
    ]:
        scheduler = make_scheduler(structured_output_manager=manager, **kwargs)
        executor = GrammarSimExecutor(vocab_size)
        seen_placeholder_plans = []
        num_pending_plans = [0]

        def exact(req_ids: list[str], scheduler=scheduler) -> None:
            # Every mask is exact: the only in-flight token of its request is the one
            # this (already in flight) step samples; the matcher has all the others.
            for rid in req_ids:
                assert scheduler.in_flight.num_placeholders(scheduler.get_request(rid)) == 1

        def on_plan(plan: StepPlan, scheduler=scheduler, seen=seen_placeholder_plans,
                    num_pending=num_pending_plans) -> None:
            exact(plan.structured_output_req_ids)
            if plan.pending_structured_output_tokens:
                assert not plan.structured_output_req_ids and not plan.grammar_bitmask
                num_pending[0] += 1
            seen.append(len(scheduler.in_flight))

        for r in _requests(tokenizer):
            scheduler.add_request(r)
        outputs = run(scheduler, executor, in_flight, on_plan,
                      on_grammar=lambda g: exact(g.structured_output_req_ids))
        _check_valid(outputs, tokenizer)
        assert executor.num_masked_rows == sum(
            len(outputs[r].token_ids) for r in ("re", "choice", "json"))
        if "preempt" in mode:
            assert scheduler.num_preemptions > 0
        if "async" in mode:
            assert max(seen_placeholder_plans) == 2  # decodes did overlap
        # Constrained requests planned on placeholders: only under async scheduling.
        assert (num_pending_plans[0] > 0) == ("async" in mode)
        assert manager.num_matchers == 0  # every finished request forgot its matcher
        results[mode] = {rid: o.token_ids for rid, o in outputs.items()}
    # Tokens depend on the history only: every mode gives the same outputs (free1, with
    # the longest prompt, is cut by the small KV cache's max_len in the preempt modes).
    diff = {m: [rid for rid in ("re", "choice", "json", "free0")
                if r[rid] != results["sync"][rid]] for m, r in results.items()}
    assert diff == {m: [] for m in results}


@pytest.mark.parametrize("so", [StructuredOutputsParams(regex=REGEX),
                                StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)],
                         ids=["regex", "json"])
def test_async_scheduling_decodes_a_constrained_request_in_every_step(manager, tokenizer,
                                                                      vocab_size, so):
    tokens = {}
    for async_scheduling in (False, True):
        scheduler = make_scheduler(structured_output_manager=manager,
                                   async_scheduling=async_scheduling)
        scheduler.add_request(_req("c", tokenizer, so, max_tokens=64))
        plans: list[StepPlan] = []
        outputs = run(scheduler, GrammarSimExecutor(vocab_size), 2 if async_scheduling else 1,
                      on_plan=plans.append)
        out = outputs["c"]
        assert out.finish_reason == "stop" and out.token_ids[-1] == tokenizer.eos_token_id
        num_tokens = len(out.token_ids)
        assert num_tokens > 5
        assert all(p.scheduled_req_ids == ["c"] for p in plans)
        if not async_scheduling:
            assert len(plans) == num_tokens  # one step per token
            assert not any(p.pending_structured_output_tokens for p in plans)
        else:
            # One step per token, plus the speculative step planned while the EOS was
            # in flight (its token dropped). Every decode step's bitmask followed it.
            assert len(plans) == num_tokens + 1
            assert [p.pending_structured_output_tokens for p in plans] == (
                [False] + [True] * num_tokens)
        tokens[async_scheduling] = out.token_ids
    assert tokens[True] == tokens[False]


class HeldManager(StructuredOutputManager):
    """Compiles of `held_spec` wait until the test releases them."""

    def __init__(self, *args, held_spec: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.held_spec = held_spec
        self.release: Future = Future()

    def grammar_future(self, kind, spec, options, eos_token_id=None):
        inner = super().grammar_future(kind, spec, options, eos_token_id)
        if spec != self.held_spec:
            return inner
        outer: Future = Future()
        self.release.add_done_callback(lambda _: inner.add_done_callback(
            lambda f: outer.set_result(f.result())))
        return outer


def test_a_compiling_grammar_waits_without_blocking_others(tokenizer, vocab_size):
    manager = HeldManager("auto", vocab_size=vocab_size, tokenizer=tokenizer, held_spec=REGEX)
    scheduler = make_scheduler(structured_output_manager=manager)
    executor = GrammarSimExecutor(vocab_size)
    scheduler.add_request(_req("re", tokenizer, StructuredOutputsParams(regex=REGEX)))
    scheduler.add_request(_req("free", tokenizer, None, max_tokens=4))
    outputs: dict[str, Finished] = {}
    for _ in range(4):
        plan = scheduler.schedule()
        assert plan.scheduled_req_ids == ["free"]
        assert scheduler.get_request("re").status == RequestStatus.WAITING
        collect(scheduler.update_from_output(plan, executor.execute(plan)), outputs)
    assert outputs["free"].finish_reason == "length"
    assert scheduler.num_compiling_grammars == 1 and not scheduler.schedule().scheduled_req_ids
    manager.release.set_result(None)
    outputs.update(run(scheduler, executor))
    assert outputs["re"].finish_reason == "stop"
    assert re.fullmatch(REGEX, tokenizer.decode(outputs["re"].token_ids,
                                                skip_special_tokens=True))
    manager.shutdown()


def test_bad_grammar_fails_alone_and_refused_token_fails_the_request(manager, tokenizer,
                                                                      vocab_size):
    scheduler = make_scheduler(structured_output_manager=manager)
    executor = GrammarSimExecutor(vocab_size)
    for r in _requests(tokenizer):
        scheduler.add_request(r)
    scheduler.add_request(_req("bad", tokenizer, StructuredOutputsParams(grammar="root ::= (")))
    scheduler.add_request(_req("forced", tokenizer, StructuredOutputsParams(regex="[0-9]{4}")))
    executor.force["forced"] = tokenizer.encode("x", add_special_tokens=False)[0]
    scheduler.add_request(_req("cut", tokenizer, StructuredOutputsParams(
        json=SCHEMA, disable_any_whitespace=True), max_tokens=3))
    outputs = run(scheduler, executor)
    _check_valid(outputs, tokenizer)
    assert outputs["bad"].finish_reason == "error" and outputs["bad"].token_ids == []
    assert "structured_outputs.grammar is invalid" in outputs["bad"].error
    assert outputs["forced"].finish_reason == "error"
    assert "does not match the grammar" in outputs["forced"].error
    assert is_request_error(outputs["forced"].error)  # answered 400: the request's fault
    assert outputs["cut"].finish_reason == "length" and len(outputs["cut"].token_ids) == 3


@pytest.mark.parametrize(("kwargs", "in_flight"), [({}, 1), ({"async_scheduling": True}, 2)])
def test_a_refused_token_is_not_in_the_errored_output(manager, tokenizer, vocab_size, kwargs,
                                                      in_flight):
    """A token its grammar refuses (what the sampler draws from an all -inf row: token 0)
    fails the request without joining its output: the tokens the grammar accepted, then
    the error; no stray token, in the delta or the request."""
    scheduler = make_scheduler(structured_output_manager=manager, **kwargs)
    executor = GrammarSimExecutor(vocab_size)
    req = _req("forced", tokenizer, StructuredOutputsParams(regex="[0-9]{6}"))
    scheduler.add_request(req)

    def refuse_the_third(plan) -> None:  # two digits after the 20 prompt tokens, then 0
        if len(executor.tokens.get("forced", [])) == 20 + 2:
            executor.force["forced"] = 0

    outputs = run(scheduler, executor, in_flight, on_plan=refuse_the_third)
    out = outputs["forced"]
    assert out.finish_reason == "error" and is_request_error(out.error)
    assert "token 0, drawn from an empty mask" in out.error and "after 2 output tokens" in out.error
    assert len(out.token_ids) == 2 and 0 not in out.token_ids
    assert re.fullmatch("[0-9]{2}", tokenizer.decode(out.token_ids)), out.token_ids
    assert req.output_token_ids == out.token_ids


def test_structured_request_without_a_manager_is_refused(tokenizer):
    scheduler = make_scheduler()
    with pytest.raises(ValueError, match="no structured output support"):
        scheduler.add_request(_req("re", tokenizer, StructuredOutputsParams(regex="a")))
    assert not scheduler.has_unfinished_requests()
