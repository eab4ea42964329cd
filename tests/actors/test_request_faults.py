"""One request's failure fails that request only, on the multiproc placement (issue #21):
a message the ring cannot encode (item 1), any exception in the tokenizer actor (item
11), a prompt the KV cache cannot hold (item 10); and a stalled executor turns the
health check red, then restarts the group (item 9).

Edge validation is bypassed on purpose (the tokenizer actor's output is altered after
validation), so these hold even if a field slips past validation.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import msgspec
import pytest

from flowengine import SamplingParams
from flowengine.engine.protocol import EngineDeadError
from flowengine.entrypoints.async_engine import AsyncEngine
from flowengine.sampling_params import RequestOutputKind

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
NUM_KV_BLOCKS = 12  # 192 tokens of 16: less than the model's max_model_len (8192)


async def _text(engine: AsyncEngine, prompt, params=GREEDY) -> str:
    text = ""
    async for out in engine.submit(prompt, params, output_kind=RequestOutputKind.DELTA):
        text += out.outputs[0].text
    return text


def _with_children(process, **fields):
    """Wrap TokenizerActor._process: its children get `fields` (after validation)."""

    def patched(job):
        processed = process(job)
        processed.children = [msgspec.structs.replace(c, **fields) for c in processed.children]
        return processed

    return patched


def test_one_request_fails_alone_on_multiproc(default_model_path, monkeypatch):
    monkeypatch.setenv("FLOWENGINE_STEP_STALL_UNHEALTHY_S", "1")
    monkeypatch.setenv("FLOWENGINE_EXECUTE_MODEL_TIMEOUT_S", "6")

    async def main():
        engine = AsyncEngine(default_model_path, placement="multiproc",
                             num_kv_blocks=NUM_KV_BLOCKS)
        await engine.start()
        try:
            reference = await _text(engine, "The sea was calm and")
            assert reference
            actor = engine.tokenizer_actor
            process = actor._process

            # Item 1: an int above 2**64-1 cannot be encoded for the ring.
            for fields in ({"priority": 2**64}, {"eos_token_id": -(2**63) - 1}):
                actor._process = _with_children(process, **fields)
                with pytest.raises(ValueError, match="cannot be encoded for the engine"):
                    await _text(engine, "The sea was calm and")
                actor._process = process
                assert await _text(engine, "The sea was calm and") == reference
                await engine.check_health()
            # n=2 where the second child fails: the first, already sent, is aborted.
            n2 = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, n=2)

            def second_child_bad(job):
                processed = process(job)
                processed.children[1] = msgspec.structs.replace(processed.children[1],
                                                                priority=2**65)
                return processed

            actor._process = second_child_bad
            with pytest.raises(ValueError, match="cannot be encoded"):
                await _text(engine, "The sea was calm and", n2)
            actor._process = process
            assert len(engine.detokenizer.processor) == 0  # nothing left behind
            assert await _text(engine, "The sea was calm and") == reference

            # Item 11: any exception while processing one request, MemoryError included.
            for exc in (MemoryError(), RuntimeError("tokenizer broke"), KeyError("x")):
                def boom(job, exc=exc):
                    raise exc

                actor._process = boom
                with pytest.raises(type(exc)):
                    await _text(engine, "The sea was calm and")
                actor._process = process
                assert await _text(engine, "The sea was calm and") == reference
                await engine.check_health()

            # Item 10: the KV cache holds 192 tokens and max_model_len was not set, so it
            # is lowered to 192: a 701-token prompt is a ValueError (HTTP 400).
            assert engine.max_model_len == NUM_KV_BLOCKS * 16
            with pytest.raises(ValueError, match="max_model_len is 192"):
                await _text(engine, list(range(1000, 1701)))
            await engine.check_health()

            # Item 9: SIGSTOP the executor while a request waits: unhealthy after 1 s,
            # group restarted after 6 s, and the request completes with its text.
            task = asyncio.create_task(_text(engine, "The sea was calm and",
                                              SamplingParams(temperature=0, max_tokens=40,
                                                             ignore_eos=True)))
            while engine.get_stats().generation_tokens_total == 0 or not len(
                    engine.detokenizer.processor):
                await asyncio.sleep(0.01)
            executor_pid = engine.supervisor.pids["executor"][0]
            restarts = engine.supervisor.num_restarts
            os.kill(executor_pid, signal.SIGSTOP)
            t0 = time.monotonic()
            try:
                await asyncio.sleep(0.5)
                await engine.check_health()  # under 1 s: still healthy
                deadline = t0 + 5.0
                while True:
                    try:
                        await engine.check_health()
                    except EngineDeadError as err:
                        assert "stalled" in str(err)
                        break
                    assert time.monotonic() < deadline, "health stayed green"
                    await asyncio.sleep(0.1)
                assert time.monotonic() - t0 >= 1.0
                text = await asyncio.wait_for(task, 120)
            finally:
                try:
                    os.kill(executor_pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            assert engine.supervisor.num_restarts == restarts + 1
            assert time.monotonic() - t0 >= 6.0
            assert text.startswith(reference)
            await engine.check_health()
        finally:
            await engine.shutdown(drain_timeout_s=5)

    asyncio.run(main())


def test_max_model_len_the_kv_cache_cannot_hold_is_refused(default_model_path):
    """vLLM's rule: a max_model_len set by the user must fit the KV cache, else start-up
    stops with the numbers and what to change (inproc here; the executor process of
    multiproc raises the same error in build_executor)."""

    async def main():
        engine = AsyncEngine(default_model_path, max_model_len=1024, num_kv_blocks=NUM_KV_BLOCKS)
        with pytest.raises(ValueError) as err:
            await engine.start()
        assert str(err.value) == (
            "max_model_len 1024 needs 64 KV blocks of 16 tokens, but the KV cache holds 12 "
            "blocks (192 tokens); lower max_model_len to 192 or less, or give the KV cache "
            "more room (num_kv_blocks, kv_cache_memory_bytes, gpu_memory_utilization)"
        )

    asyncio.run(main())
