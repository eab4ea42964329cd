"""The multiproc placement: engine and executor processes over shared-memory rings.

Same greedy tokens as inproc (overlap on and off); kill -9 of the executor or the
engine process while 32 streams run: every stream completes with exactly the text of
an undisturbed run; an idle engine burns (almost) no CPU; no segment is left behind.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from flowengine import SamplingParams
from flowengine.entrypoints.async_engine import AsyncEngine
from flowengine.sampling_params import RequestOutputKind

pytestmark = pytest.mark.slow

PROMPTS = [f"Story {i}: once upon a time, in a village by the sea," for i in range(32)]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
CLK_TCK = os.sysconf("SC_CLK_TCK")


async def _stream(engine: AsyncEngine, prompt: str) -> tuple[str, list[int]]:
    text, ids = "", []
    async for out in engine.submit(prompt, GREEDY, output_kind=RequestOutputKind.DELTA):
        text += out.outputs[0].text
        ids += out.outputs[0].token_ids
    return text, ids


async def _run_all(engine: AsyncEngine, prompts=PROMPTS, kill_role: str | None = None):
    tasks = [asyncio.create_task(_stream(engine, p)) for p in prompts]
    if kill_role is not None:
        # Kill once some tokens have been delivered, while every stream is running.
        while engine.get_stats().generation_tokens_total < 2 * len(prompts):
            await asyncio.sleep(0.05)
        os.kill(engine.supervisor.pids[kill_role][0], signal.SIGKILL)
    return await asyncio.gather(*tasks)


def _segments_of(run_id: str) -> list[str]:
    prefix = f"fe-{run_id}-"
    return [f for f in os.listdir("/dev/shm") if f.startswith((prefix, "sem." + prefix))]


@pytest.fixture(scope="module")
def inproc_reference(default_model_path) -> list[tuple[str, list[int]]]:
    async def main():
        engine = AsyncEngine(default_model_path, max_model_len=512)
        await engine.start()
        try:
            return await _run_all(engine)
        finally:
            await engine.shutdown(drain_timeout_s=5)

    return asyncio.run(main())


def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_multiproc_equals_inproc_and_survives_kills(
    default_model_path, inproc_reference, async_scheduling
):
    async def main():
        engine = AsyncEngine(default_model_path, max_model_len=512, placement="multiproc",
                             async_scheduling=async_scheduling)
        await engine.start()
        run_id = engine.supervisor.run_id
        assert len(_segments_of(run_id)) >= 4
        try:
            assert await _run_all(engine) == inproc_reference
            if async_scheduling:
                return  # the kill and idle checks do not depend on the overlap
            for role in ("executor", "engine"):
                before = engine.supervisor.num_restarts
                assert await _run_all(engine, kill_role=role) == inproc_reference
                assert engine.supervisor.num_restarts == before + 1
            # Idle: the whole group (frontend included) under 15% of one core. A polling
            # loop costs a whole core; the sleeping waiters' timed slices and the
            # supervisor's liveness checks cost ~1-5% on a loaded 2-core CI machine (a
            # 2% bound over 3 s failed there once at 2.7%, a 5% one over 4 s at 5.5%,
            # 3.75% of it the frontend's process: this pytest process, whatever earlier
            # tests left running in it), so the bound leaves room for them and still
            # fails a poller by a wide margin; 4 s is 400 ticks of the 10 ms clock.
            await asyncio.sleep(1.0)
            pids = [os.getpid(), *engine.supervisor.pids["engine"],
                    *engine.supervisor.pids["executor"]]
            start = {p: _cpu_ticks(p) for p in pids}
            t0 = time.monotonic()
            await asyncio.sleep(4.0)
            elapsed = time.monotonic() - t0
            used = {p: (_cpu_ticks(p) - start[p]) / CLK_TCK for p in pids}
            share = sum(used.values()) / elapsed
            assert share < 0.15, f"idle engine used {share:.1%} of a core (s by pid: {used})"
        finally:
            await engine.shutdown(drain_timeout_s=10)
        assert _segments_of(run_id) == []

    asyncio.run(main())
