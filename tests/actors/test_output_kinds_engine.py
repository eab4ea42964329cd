"""`AsyncEngine.submit(output_kind=...)` on the default model, inproc and multiproc.

Three requests at once (CUMULATIVE, DELTA, FINAL_ONLY), n=2, greedy, logprobs, a stop
string taken from the middle of the unstopped text (so text is held back while it may
start the stop string): FINAL_ONLY gives exactly one output, the whole result; joining
the DELTA outputs gives that result; every CUMULATIVE output extends the previous one
and the last is that result. Multiproc kills the executor while they run: after the
recompute each kind still delivers no token twice, and equals inproc.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from flowengine import SamplingParams
from flowengine.entrypoints.async_engine import AsyncEngine
from flowengine.outputs import CompletionOutput, RequestOutput
from flowengine.sampling_params import RequestOutputKind

pytestmark = pytest.mark.slow

K = RequestOutputKind
PROMPT = "Once upon a time, in a village by the sea, there lived"
BASE = SamplingParams(n=2, temperature=0, max_tokens=32, ignore_eos=True, logprobs=1)


def _sampled_logprobs(c: CompletionOutput) -> list[float]:
    assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
    return [entry[t].logprob for entry, t in zip(c.logprobs, c.token_ids, strict=True)]


def _result(c: CompletionOutput) -> tuple:
    return (c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason)


async def _collect(engine: AsyncEngine, params: SamplingParams, kind: RequestOutputKind
                   ) -> list[RequestOutput]:
    return [out async for out in engine.submit(PROMPT, params, output_kind=kind)]


def _stop_params(reference: RequestOutput) -> tuple[SamplingParams, str]:
    """A stop string from the middle of sample 0's unstopped text (first occurrence)."""
    text = reference.outputs[0].text
    k = len(text) // 2
    while text.find(text[k:k + 3]) != k:
        k += 1
    stop = text[k:k + 3]
    return BASE.clone(stop=[stop]), stop


def _check_kinds(runs: dict[RequestOutputKind, list[RequestOutput]], reference: RequestOutput,
                 stop: str) -> list[tuple]:
    """Assert each kind's outputs; returns the final result (per completion)."""
    (final,) = runs[K.FINAL_ONLY]  # exactly one output
    assert final.finished and [c.index for c in final.outputs] == [0, 1]
    for c, ref in zip(final.outputs, reference.outputs, strict=True):
        at = ref.text.find(stop)
        assert at != -1  # greedy: both samples are the same text
        assert (c.text, c.finish_reason, c.stop_reason) == (ref.text[:at], "stop", stop)
        # The tokens up to the one that completed the stop string, none after.
        assert c.token_ids == ref.token_ids[: len(c.token_ids)]
        assert ref.text.startswith(c.text + stop) and len(c.token_ids) < len(ref.token_ids)
        assert _sampled_logprobs(c) == pytest.approx(_sampled_logprobs(ref)[: len(c.token_ids)],
                                                     abs=1e-4)
    expected = [_result(c) for c in final.outputs]

    deltas = runs[K.DELTA]
    assert [o.finished for o in deltas] == [False] * (len(deltas) - 1) + [True]
    for c in final.outputs:
        mine = [d for o in deltas for d in o.outputs if d.index == c.index]
        assert [d.finish_reason for d in mine[:-1]] == [None] * (len(mine) - 1)
        assert "".join(d.text for d in mine) == c.text
        assert [t for d in mine for t in d.token_ids] == c.token_ids  # no token twice
        assert [v for d in mine for v in _sampled_logprobs(d)] == pytest.approx(
            _sampled_logprobs(c), abs=1e-4)
        assert (mine[-1].finish_reason, mine[-1].stop_reason) == ("stop", stop)

    cumulative = runs[K.CUMULATIVE]
    assert [o.finished for o in cumulative] == [False] * (len(cumulative) - 1) + [True]
    previous = {0: [], 1: []}
    for o in cumulative:
        assert [c.index for c in o.outputs] == [0, 1]  # every output holds both samples
        for c in o.outputs:
            ids = previous[c.index]
            assert c.token_ids[: len(ids)] == ids  # extends what came before
            assert len(c.logprobs) == len(c.token_ids)
            previous[c.index] = c.token_ids
    assert [_result(c) for c in cumulative[-1].outputs] == expected
    for c, f in zip(cumulative[-1].outputs, final.outputs, strict=True):
        assert _sampled_logprobs(c) == pytest.approx(_sampled_logprobs(f), abs=1e-4)
    return expected


async def _all_kinds(engine: AsyncEngine, params: SamplingParams, kill: bool = False):
    base = engine.get_stats().generation_tokens_total
    tasks = {k: asyncio.create_task(_collect(engine, params, k)) for k in K}
    if kill:
        # Once every request has tokens, well before any finished (6 tokens a step).
        while engine.get_stats().generation_tokens_total < base + 12:
            await asyncio.sleep(0.02)
        os.kill(engine.supervisor.pids["executor"][0], signal.SIGKILL)
    return {k: await t for k, t in tasks.items()}


@pytest.fixture(scope="module")
def inproc_results(default_model_path):
    async def main():
        engine = AsyncEngine(default_model_path, max_model_len=512)
        await engine.start()
        try:
            [reference] = await _collect(engine, BASE, K.FINAL_ONLY)
            params, stop = _stop_params(reference)
            return reference, stop, _check_kinds(await _all_kinds(engine, params), reference,
                                                 stop)
        finally:
            await engine.shutdown(drain_timeout_s=5)

    return asyncio.run(main())


def test_inproc_each_kind(inproc_results) -> None:
    reference, stop, expected = inproc_results
    assert [c.finish_reason for c in reference.outputs] == ["length", "length"]
    assert all(len(c.token_ids) == 32 for c in reference.outputs)
    assert expected[0][1:] == expected[1][1:]  # greedy: both samples alike


def test_multiproc_each_kind_survives_an_executor_kill(default_model_path,
                                                       inproc_results) -> None:
    reference, stop, expected = inproc_results

    async def main():
        engine = AsyncEngine(default_model_path, max_model_len=512, placement="multiproc")
        await engine.start()
        try:
            params = BASE.clone(stop=[stop])
            assert _check_kinds(await _all_kinds(engine, params), reference, stop) == expected
            before = engine.supervisor.num_restarts
            runs = await _all_kinds(engine, params, kill=True)
            assert engine.supervisor.num_restarts == before + 1
            assert _check_kinds(runs, reference, stop) == expected
        finally:
            await engine.shutdown(drain_timeout_s=10)

    asyncio.run(main())
