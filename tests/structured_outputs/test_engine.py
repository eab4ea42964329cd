"""Structured outputs through the engines: LLM (in-process), AsyncEngine in-process
and the multiproc actor pipeline of `flowengine serve`, with async scheduling and an
engine-process kill (the restarted engine replays the delivered tokens into fresh
matchers). Greedy, so every placement must give the same tokens.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal

import pytest

from flowengine import LLM, SamplingParams, StructuredOutputsParams
from flowengine.entrypoints.async_engine import AsyncEngine
from flowengine.sampling_params import RequestOutputKind

pytestmark = pytest.mark.slow

REGEX = r"(Mon|Tues|Wednes|Thurs|Fri)day at [1-9]:[0-5][0-9] (am|pm)"
CHOICES = ["red", "green", "blue", "yellow"]
SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
    "capital": {"type": "boolean"}},
    "required": ["city", "population", "capital"], "additionalProperties": False}
CASES = [
    ("When is the meeting?", StructuredOutputsParams(regex=REGEX)),
    ("What colour is the sky?", StructuredOutputsParams(choice=CHOICES)),
    ("Describe Paris as JSON.", StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)),
]


def _greedy(so: StructuredOutputsParams, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=48, n=n, structured_outputs=so)


def _check(text: str, so: StructuredOutputsParams) -> None:
    if so.regex is not None:
        assert re.fullmatch(REGEX, text), text
    elif so.choice is not None:
        assert text in CHOICES, text
    else:
        instance = json.loads(text)
        assert set(instance) == {"city", "population", "capital"}, text


@pytest.fixture(scope="module")
def llm(default_model_path):
    engine = LLM(default_model_path, max_model_len=512, seed=0)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def reference(llm) -> list[list[int]]:
    outs = llm.generate([p for p, _ in CASES], [_greedy(so) for _, so in CASES],
                        use_tqdm=False)
    for out, (_, so) in zip(outs, CASES, strict=True):
        assert out.outputs[0].finish_reason == "stop"
        _check(out.outputs[0].text, so)
    return [out.outputs[0].token_ids for out in outs]


def test_a_constraint_greedy_already_satisfies_leaves_greedy_ids_unchanged(llm):
    prompts = ["The capital of France is", "List three fruits:", "def fibonacci(n):"]
    free = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    params = []
    for out in free:
        text = out.outputs[0].text
        # Only the characters greedy used, in any order and number: a mask that removes
        # most of the vocabulary, yet keeps every greedy token (and EOS anywhere).
        chars = "".join(sorted(set(text)))
        escapes = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}
        regex = "[" + "".join(escapes.get(c, "\\" + c if c in "\\]^-[" else c)
                              for c in chars) + "]*"
        params.append(SamplingParams(temperature=0, max_tokens=24,
                                     structured_outputs=StructuredOutputsParams(regex=regex)))
    constrained = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(free, constrained, strict=True):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].finish_reason == a.outputs[0].finish_reason


def test_llm_constrained_n_and_logprobs(llm, reference):
    outs = llm.generate([p for p, _ in CASES],
                        [SamplingParams(temperature=1.0, n=3, max_tokens=48, seed=7, logprobs=2,
                                        structured_outputs=so) for _, so in CASES],
                        use_tqdm=False)
    for out, (_, so) in zip(outs, CASES, strict=True):
        assert len(out.outputs) == 3
        for sample in out.outputs:
            assert sample.finish_reason == "stop"
            _check(sample.text, so)
            # logprobs come from the masked logits (vLLM): the sampled token's is finite,
            # and for the choice an alternative is finite only if the grammar allowed it.
            for token_id, lp in zip(sample.token_ids, sample.logprobs, strict=True):
                assert lp[token_id].logprob > float("-inf")
            if so.choice is not None:
                tok = llm.input_processor.tokenizer
                for token_id, value in sample.logprobs[0].items():
                    piece = tok.decode([token_id])
                    allowed = any(c.startswith(piece) for c in CHOICES)
                    assert (value.logprob > float("-inf")) == allowed, (piece, value)
    greedy = llm.generate([p for p, _ in CASES], [_greedy(so, n=2) for _, so in CASES],
                          use_tqdm=False)
    assert [[s.token_ids for s in o.outputs] for o in greedy] == [[r, r] for r in reference]


def test_invalid_constraint_is_refused_and_the_engine_keeps_serving(llm, reference):
    with pytest.raises(ValueError, match=r"structured_outputs\.regex is invalid"):
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(
            regex="a(")), use_tqdm=False)
    with pytest.raises(ValueError, match="uses a JSON-schema feature that is not supported"):
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(
            json={"type": "object", "properties": {"a": {"not": {}}}})), use_tqdm=False)
    outs = llm.generate([CASES[0][0]], _greedy(CASES[0][1]), use_tqdm=False)
    assert outs[0].outputs[0].token_ids == reference[0]


@pytest.mark.parametrize("constraint", ["allowed_token_ids", "min_tokens"])
def test_a_grammar_left_without_tokens_errors_without_a_stray_token(llm, constraint):
    """choice "red" with allowed_token_ids that exclude it (no first token) or min_tokens
    past its end (no token after "red"): the sampler draws token 0 from the all -inf
    row, the grammar refuses it, and the request ends with the error; the output holds
    only what the grammar accepted (no token 0, nor its text or logprob)."""
    tok = llm.input_processor.tokenizer
    if constraint == "allowed_token_ids":
        extra, accepted = {"allowed_token_ids": tok.encode("x", add_special_tokens=False)}, ""
    else:
        extra, accepted = {"min_tokens": 8}, "red"
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=1, **extra,
                            structured_outputs=StructuredOutputsParams(choice=["red"]))
    (out,) = llm.generate(["Name a colour."], params, use_tqdm=False)
    sample = out.outputs[0]
    assert sample.finish_reason == "error" and "drawn from an empty mask" in out.error
    assert 0 not in sample.token_ids and sample.text == accepted
    assert tok.decode(sample.token_ids) == accepted
    assert len(sample.logprobs) == len(sample.token_ids)


def test_max_tokens_cut_is_length(llm):
    out = llm.generate([CASES[2][0]], SamplingParams(temperature=0, max_tokens=4,
                                                     structured_outputs=CASES[2][1]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4


async def _stream(engine: AsyncEngine, prompt: str, params: SamplingParams) -> list[int]:
    ids: list[int] = []
    async for out in engine.submit(prompt, params, output_kind=RequestOutputKind.DELTA):
        ids += out.outputs[0].token_ids
    return ids


@pytest.mark.parametrize("offload_rows", ["", "1"])
def test_async_scheduling_decodes_a_constrained_request_in_every_step(default_model_path,
                                                                      reference, monkeypatch,
                                                                      offload_rows):
    # The executor launches step N+1's forward before N's token is known and samples it
    # with the bitmask the scheduler sends once N's token was accepted. So beside an
    # unconstrained request that keeps two steps in flight, a constrained request is in
    # every plan from its first token to its last (no step skipped to wait for its
    # mask), one plan per token plus the speculative one planned while its EOS was in
    # flight; and greedy ids are those of the offline engine. offload_rows "1": the
    # Scheduler actor advances the matchers and fills the next bitmask in its worker
    # thread from one constrained row (default: from 32, so inline here).
    monkeypatch.setenv("FLOWENGINE_GRAMMAR_OFFLOAD_ROWS", offload_rows)

    async def main():
        engine = AsyncEngine(default_model_path, max_model_len=512, placement="inproc",
                             async_scheduling=True)
        await engine.start()
        core = engine.core
        plans: list[list[str]] = []  # the constrained requests of each plan
        schedule = core.schedule

        def recording_schedule():
            plan = schedule()
            if plan is not None:
                get = core.scheduler.get_request
                plans.append([rid for rid in plan.scheduled_req_ids
                              if get(rid).sampling_params.structured_outputs is not None])
            return plan

        core.schedule = recording_schedule
        try:
            free = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
            background = asyncio.create_task(_stream(engine, "Once upon a time", free))
            await asyncio.sleep(0)
            results = await asyncio.gather(*(_stream(engine, p, _greedy(so)) for p, so in CASES))
            assert results == reference
            assert len(await background) == 64
            assert not core.scheduler.has_unfinished_requests()
            for rid in {rid for plan in plans for rid in plan}:
                steps = [i for i, plan in enumerate(plans) if rid in plan]
                assert steps == list(range(steps[0], steps[-1] + 1)), steps  # every step
            # One plan per token (+1): each request's count is one of the references'.
            counts = sorted(sum(rid in plan for plan in plans)
                            for rid in {rid for plan in plans for rid in plan})
            assert counts == sorted(len(ids) + 1 for ids in reference)
        finally:
            await engine.shutdown(drain_timeout_s=10)

    asyncio.run(main())


def test_a_constrained_request_is_admitted_while_others_keep_the_grammar_work_going(
        default_model_path, monkeypatch):
    # With the grammar work in the Scheduler actor's worker thread at every step (offload
    # from 1 row), a constrained request that arrives while another decodes starts within
    # a few steps, not after the other finishes (a version that planned each next step
    # during the grammar work, where no matcher may be made, starved it).
    monkeypatch.setenv("FLOWENGINE_GRAMMAR_OFFLOAD_ROWS", "1")

    async def main():
        engine = AsyncEngine(default_model_path, max_model_len=512, placement="inproc",
                             async_scheduling=True)
        await engine.start()
        try:
            long = SamplingParams(temperature=0, max_tokens=96, structured_outputs=(
                StructuredOutputsParams(regex="[a-z ]{2000}")))
            short = SamplingParams(temperature=0, max_tokens=8, structured_outputs=(
                StructuredOutputsParams(regex="[a-z]{2,4}")))
            progress = []

            async def run_long():
                async for out in engine.submit("Write a long story.", long,
                                               output_kind=RequestOutputKind.DELTA):
                    progress.append(len(out.outputs[0].token_ids))
                return sum(progress)

            background = asyncio.create_task(run_long())
            while sum(progress) < 8:
                await asyncio.sleep(0.005)
            ids = await _stream(engine, "Say a short word.", short)
            long_tokens_when_short_done = sum(progress)
            assert 1 <= len(ids) <= 8
            assert await background == 96
            assert long_tokens_when_short_done < 96 - 16, long_tokens_when_short_done
        finally:
            await engine.shutdown(drain_timeout_s=10)

    asyncio.run(main())


@pytest.mark.parametrize(("placement", "async_scheduling"),
                         [("inproc", False), ("multiproc", True)])
def test_async_engine_placements_and_restart(default_model_path, reference, placement,
                                             async_scheduling):
    async def main():
        engine = AsyncEngine(default_model_path, max_model_len=512, placement=placement,
                             async_scheduling=async_scheduling)
        await engine.start()
        try:
            unconstrained = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
            tasks = [asyncio.create_task(_stream(engine, p, _greedy(so))) for p, so in CASES]
            tasks.append(asyncio.create_task(_stream(engine, "Once upon a time", unconstrained)))
            assert (await asyncio.gather(*tasks))[:3] == reference
            if placement != "multiproc":
                return
            # Kill the engine process mid-generation: the new one replays each request's
            # delivered tokens into a fresh matcher and carries on.
            start = engine.get_stats().generation_tokens_total
            tasks = [asyncio.create_task(_stream(engine, p, _greedy(so))) for p, so in CASES]
            while engine.get_stats().generation_tokens_total < start + 4:
                await asyncio.sleep(0.01)
            before = engine.supervisor.num_restarts
            os.kill(engine.supervisor.pids["engine"][0], signal.SIGKILL)
            assert await asyncio.gather(*tasks) == reference
            assert engine.supervisor.num_restarts == before + 1
        finally:
            await engine.shutdown(drain_timeout_s=10)

    asyncio.run(main())
