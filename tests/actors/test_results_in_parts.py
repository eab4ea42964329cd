"""A step result larger than one record of the results ring goes in parts
(`split_step_result` / `join_step_result`): full-vocabulary logprobs for several
requests in one step reached the scheduler as an error for every request in it (the
GPU FP8 test's logprobs=-1 over 8 prompts: 10.4 MB against the 8 MB ring)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from flowengine import SamplingParams
from flowengine.messages import (
    SampledTokens,
    StepResult,
    TokenLogprobs,
    join_step_result,
    split_step_result,
)
from flowengine.sampling_params import RequestOutputKind


def _sampled(req: int, width: int) -> SampledTokens:
    lp = TokenLogprobs(list(range(width)), [-float(i) for i in range(width)], -1.0, 1)
    return SampledTokens(f"r{req}", [req], logprobs=[lp])


def test_split_keeps_order_and_every_part_fits() -> None:
    result = StepResult(7, [_sampled(i, 50 + 40 * i) for i in range(12)])
    whole = len(msgspec.msgpack.encode(result))
    max_bytes = whole // 3
    parts = split_step_result(result, max_bytes)
    assert parts is not None and len(parts) >= 3
    assert [p.more for p in parts] == [True] * (len(parts) - 1) + [False]
    assert all(p.step_id == 7 for p in parts)
    assert all(len(msgspec.msgpack.encode(p)) <= max_bytes for p in parts)
    joined = join_step_result(parts[0], parts[1:])
    assert joined == result  # same requests, same order, more=False


def test_split_refuses_one_request_larger_than_a_part() -> None:
    result = StepResult(3, [_sampled(0, 10), _sampled(1, 5000)])
    assert split_step_result(result, 4000) is None


def test_join_refuses_a_part_of_another_step() -> None:
    first = StepResult(1, [_sampled(0, 3)], more=True)
    with pytest.raises(RuntimeError, match="part of step 2"):
        join_step_result(first, [StepResult(2, [_sampled(1, 3)])])


def test_the_error_of_a_result_travels_in_its_last_part() -> None:
    result = StepResult(4, [_sampled(i, 200) for i in range(4)], error="boom")
    parts = split_step_result(result, len(msgspec.msgpack.encode(result)) // 2)
    assert parts is not None and len(parts) > 1
    assert [p.error for p in parts] == [None] * (len(parts) - 1) + ["boom"]
    assert join_step_result(parts[0], parts[1:]).error == "boom"


@pytest.mark.slow
def test_full_vocabulary_logprobs_of_a_batch_larger_than_the_ring(default_model_path,
                                                                  monkeypatch) -> None:
    """Four requests with logprobs=-1 (49152 entries each, ~0.6 MB of msgpack) in steps
    through a 2 MiB results ring (records of <= 2 MiB, parts of <= 1 MiB): every
    request gets its tokens and full logprobs, the same ids as without logprobs."""
    from flowengine.actors import supervisor
    from flowengine.entrypoints.async_engine import AsyncEngine

    monkeypatch.setitem(supervisor.RING_BYTES, "results", 2 << 20)
    prompts = ["The sea was calm and", "Once upon a time", "def add(a, b):",
               "The capital of France is"]

    async def collect(engine, params):
        async def one(prompt):
            final = None
            async for out in engine.submit(prompt, params,
                                           output_kind=RequestOutputKind.FINAL_ONLY):
                final = out
            return final

        return await asyncio.gather(*(one(p) for p in prompts))

    async def main():
        engine = AsyncEngine(default_model_path, placement="multiproc", max_logprobs=-1)
        await engine.start()
        try:
            plain = await collect(engine, SamplingParams(temperature=0, max_tokens=4,
                                                         ignore_eos=True))
            full = await collect(engine, SamplingParams(temperature=0, max_tokens=4,
                                                        ignore_eos=True, logprobs=-1))
            await engine.check_health()
        finally:
            await engine.shutdown()
        return plain, full

    plain, full = asyncio.run(main())
    vocab = None
    for a, b in zip(plain, full, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        logprobs = b.outputs[0].logprobs
        assert len(logprobs) == 4
        for token, entries in zip(b.outputs[0].token_ids, logprobs, strict=True):
            vocab = vocab or len(entries)
            assert len(entries) == vocab >= 49152
            assert max(entries, key=lambda t: entries[t].logprob) == token
