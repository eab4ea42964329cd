"""The wake-up floor of `flowengine bench pipeline` (issue 12): 1,000 callers, each
woken once per step through its `RequestStream` future and an async generator (as
`AsyncEngine._stream` does), 64 steps, and nothing else: no scheduler, detokenizer or
output processor. Its time per token bounds the pipeline's tokens/s from above,
whatever the actors cost.

    PYTHONPATH=TREE python3 benchmarks/pipeline_floor.py [--num-streams 1000] [--steps 64]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import AsyncIterator

from flowengine.actors.procs import new_event_loop_factory
from flowengine.actors.streamer import RequestStream


class _Output:
    """The least a stream's output needs (`RequestStream.take` reads `finished`)."""

    __slots__ = ("finished",)

    def __init__(self, finished: bool) -> None:
        self.finished = finished


async def _outputs(stream: RequestStream) -> AsyncIterator[_Output]:
    while True:  # AsyncEngine._stream's loop
        out = stream.take()
        if out is None:
            await stream.wait()
            continue
        yield out
        if out.finished:
            return


async def _caller(stream: RequestStream) -> int:
    n = 0
    async for _ in _outputs(stream):
        n += 1
    return n


async def one_run(num_streams: int, steps: int) -> tuple[float, float]:
    """(wall s, process CPU s) to deliver num_streams x steps outputs."""
    streams = [RequestStream(str(i)) for i in range(num_streams)]
    tasks = [asyncio.ensure_future(_caller(s)) for s in streams]
    await asyncio.sleep(0)
    start, cpu_start = time.perf_counter(), time.process_time()
    for step in range(steps):
        last = step == steps - 1
        for s in streams:
            s.put(_Output(last))  # type: ignore[arg-type]
        await asyncio.sleep(0)  # the callers run
        await asyncio.sleep(0)
    counts = await asyncio.gather(*tasks)
    assert sum(counts) == num_streams * steps
    return time.perf_counter() - start, time.process_time() - cpu_start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--num-streams", type=int, default=1000)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    ns = p.parse_args()
    tokens = ns.num_streams * ns.steps
    with asyncio.Runner(loop_factory=new_event_loop_factory()) as runner:
        for _ in range(ns.runs):
            wall, cpu = runner.run(one_run(ns.num_streams, ns.steps))
            print(f"wake-up floor: {1e6 * wall / tokens:.2f} us/token wall, "
                  f"{1e6 * cpu / tokens:.2f} us CPU; ceiling {tokens / wall:,.0f} tokens/s")


if __name__ == "__main__":
    main()
