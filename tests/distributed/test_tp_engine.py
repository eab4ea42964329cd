"""Tensor parallelism end to end on the CPU (gloo): one executor process per rank on
the shared `steps` broadcast ring gives the same greedy tokens as one rank, and a
killed rank restarts the whole group without changing any stream's text."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from flowengine import LLM, SamplingParams
from flowengine.entrypoints.async_engine import AsyncEngine
from flowengine.sampling_params import RequestOutputKind

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a village by the sea,",
    "Der schnelle braune Fuchs springt über",
    "1, 2, 3, 4, 5,",
    "人工知能とは",
    "Q: What is the boiling point of water?\nA:",
    "The three primary colors are",
]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _greedy_ids(model: str, tp: int) -> list[list[int]]:
    llm = LLM(model, tensor_parallel_size=tp, max_model_len=256)
    try:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def tiny_reference(tiny_llama: str) -> list[list[int]]:
    ids = _greedy_ids(tiny_llama, 1)
    # Distinct continuations: a degenerate model would make the comparison vacuous.
    assert len({tuple(s) for s in ids}) == len(PROMPTS)
    return ids


@pytest.mark.parametrize("tp", [2, 4])
def test_random_llama_tp_equals_tp1(tiny_llama: str, tiny_reference, tp: int) -> None:
    assert _greedy_ids(tiny_llama, tp) == tiny_reference


def test_smollm2_tp3_equals_tp1(default_model_path: str) -> None:
    # SmolLM2-135M: 9 query heads and 3 KV heads, 3 ranks of 3 and 1.
    assert _greedy_ids(default_model_path, 3) == _greedy_ids(default_model_path, 1)


async def _stream(engine: AsyncEngine, prompt: str) -> list[int]:
    ids: list[int] = []
    async for out in engine.submit(prompt, GREEDY, output_kind=RequestOutputKind.DELTA):
        ids += out.outputs[0].token_ids
    return ids


def test_async_scheduling_with_tp2_equals_tp1(tiny_llama: str, tiny_reference) -> None:
    """Two steps in flight over two ranks (the server's default on CUDA): rank 1 follows
    plans whose inputs hold placeholders for tokens sampled on rank 0."""
    async def main() -> list[list[int]]:
        engine = AsyncEngine(tiny_llama, tensor_parallel_size=2, max_model_len=256,
                             async_scheduling=True)
        await engine.start()
        try:
            return await asyncio.wait_for(
                asyncio.gather(*(_stream(engine, p) for p in PROMPTS)), timeout=300)
        finally:
            await engine.shutdown(drain_timeout_s=5)

    assert asyncio.run(main()) == tiny_reference


def test_killed_rank_restarts_the_group(tiny_llama: str, tiny_reference) -> None:
    async def main() -> tuple[list[list[int]], int]:
        engine = AsyncEngine(tiny_llama, tensor_parallel_size=2, max_model_len=256)
        await engine.start()
        try:
            tasks = [asyncio.create_task(_stream(engine, p)) for p in PROMPTS]
            while engine.get_stats().generation_tokens_total < 2 * len(PROMPTS):
                await asyncio.sleep(0.02)
            os.kill(engine.supervisor.pids["executor"][1], signal.SIGKILL)  # rank 1
            results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=300)
            return results, engine.supervisor.num_restarts
        finally:
            await engine.shutdown(drain_timeout_s=5)

    results, restarts = asyncio.run(main())
    assert restarts == 1
    assert results == tiny_reference
