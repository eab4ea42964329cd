"""AsyncEngine.submit() over the in-process actor pipeline, on the default model."""

from __future__ import annotations

import asyncio

import pytest

from flowengine import SamplingParams
from flowengine.entrypoints.async_engine import AsyncEngine
from flowengine.entrypoints.llm import LLM
from flowengine.sampling_params import RequestOutputKind

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time", "1, 2, 3,"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def offline(default_model_path) -> list[str]:
    llm = LLM(default_model_path, max_model_len=1024)
    return [o.outputs[0].text for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


async def _collect(engine: AsyncEngine, prompt, params=GREEDY) -> tuple[str, list]:
    text, outs = "", []
    async for out in engine.submit(prompt, params, output_kind=RequestOutputKind.DELTA):
        outs.append(out)
        text += "".join(c.text for c in out.outputs)
    return text, outs


def _blocks_free(engine: AsyncEngine) -> bool:
    s = engine.core.scheduler
    return s.num_free_blocks == s.num_total_blocks and not s.has_unfinished_requests()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_streams_equal_offline_text(default_model_path, offline, async_scheduling):
    async def main():
        engine = AsyncEngine(default_model_path, max_model_len=1024,
                             async_scheduling=async_scheduling)
        await engine.start()
        try:
            results = await asyncio.gather(*(_collect(engine, p) for p in PROMPTS))
            assert [t for t, _ in results] == offline
            for _, outs in results:
                assert outs[-1].finished and all(not o.finished for o in outs[:-1])
                assert sum(len(o.outputs[0].token_ids) for o in outs) == 24
            assert _blocks_free(engine)
        finally:
            await engine.shutdown(drain_timeout_s=5)

    asyncio.run(main())


def test_break_and_cancel_abort_and_free_blocks(default_model_path):
    async def main():
        engine = AsyncEngine(default_model_path, max_model_len=1024)
        await engine.start()
        try:
            long = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
            agen = engine.submit("Tell me a long story.", long)
            async for _ in agen:
                break
            await agen.aclose()

            async def consume():
                async for _ in engine.submit("Another long story.", long):
                    pass

            task = asyncio.create_task(consume())
            await asyncio.sleep(0.5)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(200):
                if _blocks_free(engine):
                    break
                await asyncio.sleep(0.05)
            assert _blocks_free(engine)
        finally:
            await engine.shutdown(drain_timeout_s=5)

    asyncio.run(main())


def test_bad_input_raises_and_others_continue(default_model_path, offline):
    async def main():
        engine = AsyncEngine(default_model_path, max_model_len=1024)
        await engine.start()
        try:
            good = asyncio.create_task(_collect(engine, PROMPTS[0]))
            with pytest.raises(ValueError, match="empty"):
                await _collect(engine, "")
            with pytest.raises(ValueError, match="max_model_len is 1024"):
                await _collect(engine, [7] * 1500)
            with pytest.raises(TypeError):
                await _collect(engine, 3.14)
            text, _ = await good
            assert text == offline[0]
            # output_kind as SamplingParams takes it: the enum or its int value
            outs = [o async for o in engine.submit(PROMPTS[0], GREEDY, output_kind=1)]
            assert "".join(o.outputs[0].text for o in outs) == offline[0]
            for bad, error in (("DELTA", TypeError), (True, TypeError), (3, ValueError)):
                with pytest.raises(error, match="output_kind"):
                    async for _ in engine.submit(PROMPTS[0], GREEDY, output_kind=bad):
                        pass
        finally:
            await engine.shutdown(drain_timeout_s=5)

    asyncio.run(main())


def test_chat_messages_and_abort_by_id(default_model_path):
    async def main():
        engine = AsyncEngine(default_model_path, max_model_len=1024)
        await engine.start()
        try:
            msgs = [{"role": "user", "content": "What is the capital of France?"}]
            text, _ = await _collect(engine, msgs, SamplingParams(temperature=0, max_tokens=32))
            assert "Paris" in text

            async def run_and_abort():
                outs = []
                async for out in engine.submit("Go on forever:", SamplingParams(
                        max_tokens=800, ignore_eos=True), request_id="victim",
                        output_kind=RequestOutputKind.DELTA):
                    outs.append(out)
                    if len(outs) == 2:
                        await engine.abort("victim")
                return outs

            outs = await run_and_abort()
            assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
        finally:
            await engine.shutdown(drain_timeout_s=5)

    asyncio.run(main())


def test_stream_interval_sends_fewer_outputs_with_the_same_text(default_model_path, offline):
    """--stream-interval 5: a 24-token stream comes in at most 1 + ceil(23 / 5) = 6
    outputs (the first token alone, then every 5, the last at once; fewer when the
    caller's stream folds some), and the text is the same as token by token."""
    async def main():
        engine = AsyncEngine(default_model_path, max_model_len=1024, stream_interval=5)
        await engine.start()
        try:
            results = await asyncio.gather(*(_collect(engine, p) for p in PROMPTS))
            assert [t for t, _ in results] == offline
            for _, outs in results:
                assert 2 <= len(outs) <= 6 and outs[-1].finished
                assert sum(len(o.outputs[0].token_ids) for o in outs) == 24
                assert all(len(o.outputs[0].token_ids) >= 5 for o in outs[1:-1])
        finally:
            await engine.shutdown(drain_timeout_s=5)

    asyncio.run(main())


def test_a_stopped_engine_is_collected(default_model_path):
    """start() freezes the start-up heap (gc.freeze); shutdown() must thaw it, else the
    engine's reference cycles keep its weights and KV cache alive for the life of the
    process (every test that started an engine leaked ~1.5 GB before the fix)."""
    import gc
    import weakref

    async def main() -> weakref.ref:
        engine = AsyncEngine(default_model_path, max_model_len=256)
        await engine.start()
        text, _ = await _collect(engine, "Hello", SamplingParams(temperature=0, max_tokens=2))
        assert text
        await engine.shutdown()
        return weakref.ref(engine)

    ref = asyncio.run(main())
    gc.collect()
    assert ref() is None, "the stopped AsyncEngine is still alive"


def test_stats_before_any_step_give_the_kv_block_count(default_model_path):
    # The server sizes its default --max-queue-len from get_stats() right after start,
    # before the engine has sent a stats message: it must see the real block count.
    async def main():
        engine = AsyncEngine(default_model_path, max_model_len=256)
        await engine.start()
        try:
            stats = engine.get_stats()
            assert stats.num_total_blocks == engine.core.scheduler.num_total_blocks > 0
            assert stats.num_free_blocks == stats.num_total_blocks
        finally:
            await engine.shutdown(drain_timeout_s=5)

    asyncio.run(main())


def test_submit_after_shutdown_says_the_engine_was_shut_down(default_model_path):
    """A request after `shutdown()` is refused with EngineDeadError "the engine was shut
    down"; it used to say "the engine stopped: CancelledError()", the internal way the
    actors' task ends on shutdown."""
    from flowengine.engine.protocol import EngineDeadError

    async def main():
        engine = AsyncEngine(default_model_path, max_model_len=256)
        await engine.start()
        await engine.shutdown()
        with pytest.raises(EngineDeadError, match="^the engine was shut down$"):
            await _collect(engine, "Hello")
        with pytest.raises(EngineDeadError, match="^the engine was shut down$"):
            await engine.check_health()

    asyncio.run(main())
