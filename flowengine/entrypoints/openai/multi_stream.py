"""The engine requests of one HTTP request: one per prompt, opened and read together.

/v1/completions accepts several prompts; each becomes its own engine request, opened
concurrently (all validated before the response starts) and read as one merged
stream. Closing the merged stream closes, and if unfinished aborts, every request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

from flowengine.engine.protocol import EngineClient
from flowengine.entrypoints.openai.generation import EngineStream
from flowengine.outputs import RequestOutput
from flowengine.sampling_params import SamplingParams


async def open_streams(
    engine: EngineClient,
    prompts: Sequence[str | list[int] | list[dict[str, Any]]],
    params: SamplingParams,
    base_id: str,
    **kwargs: Any,
) -> list[EngineStream]:
    """Open one stream per prompt, concurrently; on any failure close all and raise."""
    ids = [base_id] if len(prompts) == 1 else [f"{base_id}-{i}" for i in range(len(prompts))]
    tasks = [
        asyncio.ensure_future(EngineStream.open(engine, p, params, rid, **kwargs))
        for p, rid in zip(prompts, ids, strict=True)
    ]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        return [task.result() for task in tasks]
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is None:
                await task.result().aclose()
        raise


async def merge_streams(
    streams: Sequence[EngineStream],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield (stream index, output) from all streams as outputs arrive; close them all."""
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | None, BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: EngineStream) -> None:
        try:
            async for out in stream:
                await queue.put((i, out, None))
        except Exception as err:
            await queue.put((i, None, err))
            return
        await queue.put((i, None, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, out, err = await queue.get()
            if err is not None:
                raise err
            if out is None:
                remaining -= 1
                continue
            yield i, out
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


async def close_streams(streams: Sequence[EngineStream]) -> None:
    """Close every stream (aborting the unfinished ones)."""
    for stream in streams:
        await stream.aclose()
