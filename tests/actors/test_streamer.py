"""Streamer: per-request streams, merging of deltas a caller has not taken yet."""

from __future__ import annotations

import asyncio

import pytest

from flowengine.actors.streamer import RequestStream, StreamerActor
from flowengine.outputs import CompletionOutput, Logprob, RequestOutput


def delta(
    rid: str,
    *completions: tuple[int, str, list[int]],
    finished: bool = False,
    finish_reason: str | None = None,
) -> RequestOutput:
    outputs = [
        CompletionOutput(i, text, ids, finish_reason=finish_reason if finished else None)
        for i, text, ids in completions
    ]
    return RequestOutput(rid, "p", [1, 2], outputs, finished=finished)


def test_merge_concatenates_per_completion_and_keeps_the_latest_state() -> None:
    pending = delta("r", (1, "b", [2]))
    pending.outputs[0].logprobs = [{2: Logprob(-1.0)}]
    later = delta("r", (0, "a", [1]), (1, "c", [3]))
    later.outputs[1].logprobs = [{3: Logprob(-2.0)}]
    later.outputs[1].cumulative_logprob = -3.0
    last = delta("r", (0, "!", [9]), finished=True, finish_reason="length")
    last.num_cached_tokens, last.error = 16, "boom"
    pending.add(later, aggregate=True)  # RequestOutput.add, the one fold (was merge_delta)
    pending.add(last, aggregate=True)
    assert [(c.index, c.text, c.token_ids, c.finish_reason) for c in pending.outputs] == [
        (0, "a!", [1, 9], "length"),
        (1, "bc", [2, 3], None),
    ]
    assert pending.outputs[1].logprobs == [{2: Logprob(-1.0)}, {3: Logprob(-2.0)}]
    assert pending.outputs[1].cumulative_logprob == -3.0
    assert pending.finished and pending.num_cached_tokens == 16 and pending.error == "boom"
    assert pending.prompt_token_ids == [1, 2]


def test_a_slow_caller_gets_one_merged_output() -> None:
    async def main() -> None:
        stream = RequestStream("r")
        for i, piece in enumerate(["he", "ll", "o"]):
            stream.put(delta("r", (0, piece, [i]), finished=i == 2, finish_reason="stop"))
        out = await stream.get()
        assert (out.outputs[0].text, out.outputs[0].token_ids) == ("hello", [0, 1, 2])
        assert out.finished and out.outputs[0].finish_reason == "stop" and stream.finished

    asyncio.run(main())


def test_a_waiting_caller_is_woken_by_put() -> None:
    async def main() -> None:
        stream = RequestStream("r")
        getter = asyncio.ensure_future(stream.get())
        await asyncio.sleep(0)
        assert not getter.done()
        stream.put(delta("r", (0, "x", [7])))
        out = await getter
        assert out.outputs[0].token_ids == [7] and not stream.finished

    asyncio.run(main())


def test_error_comes_after_the_pending_output() -> None:
    async def main() -> None:
        stream = RequestStream("r")
        stream.put(delta("r", (0, "x", [7])))
        stream.put(RuntimeError("engine died"))
        assert (await stream.get()).outputs[0].text == "x"
        with pytest.raises(RuntimeError, match="engine died"):
            await stream.get()
        assert stream.finished

    asyncio.run(main())


def test_a_cancelled_get_loses_nothing() -> None:
    async def main() -> None:
        stream = RequestStream("r")
        getter = asyncio.ensure_future(stream.get())
        await asyncio.sleep(0)
        getter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await getter
        stream.put(delta("r", (0, "x", [7])))
        assert (await stream.get()).outputs[0].token_ids == [7]

    asyncio.run(main())


def test_take_and_wait_as_submit_uses_them() -> None:
    async def main() -> None:
        stream = RequestStream("r")
        assert stream.take() is None
        waiter = stream.wait()
        stream.put(delta("r", (0, "a", [1])))
        stream.put(delta("r", (0, "b", [2])))  # merged into the one not taken yet
        assert waiter.done()
        await waiter
        out = stream.take()
        assert out is not None and (out.outputs[0].text, out.outputs[0].token_ids) == ("ab", [1, 2])
        assert stream.take() is None and not stream.finished
        # A cancelled wait (the caller's task was cancelled) swallows no output.
        cancelled = stream.wait()
        cancelled.cancel()
        stream.put(delta("r", (0, "c", [3]), finished=True, finish_reason="stop"))
        last = stream.take()
        assert last is not None and last.outputs[0].token_ids == [3] and stream.finished
        stream.put(RuntimeError("engine died"))
        with pytest.raises(RuntimeError, match="engine died"):
            stream.take()

    asyncio.run(main())


def test_route_closes_finished_streams_and_reports_orphans() -> None:
    async def main() -> None:
        orphans: list[str] = []
        streamer = StreamerActor(on_orphan=orphans.append)
        stream = streamer.open("a")
        with pytest.raises(ValueError, match="'a' is already in use"):
            streamer.open("a")
        streamer.route([delta("a", (0, "x", [1])), delta("gone", (0, "y", [2]))])
        streamer.route([delta("a", (0, "z", [3]), finished=True, finish_reason="length")])
        streamer.route([delta("gone2", (0, "", []), finished=True)])
        assert orphans == ["gone"] and len(streamer) == 0
        out = await stream.get()
        assert (out.outputs[0].text, out.outputs[0].token_ids, out.finished) == ("xz", [1, 3], True)

    asyncio.run(main())


def test_fail_all_reaches_every_open_stream() -> None:
    async def main() -> None:
        streamer = StreamerActor()
        streams = [streamer.open(rid) for rid in ("a", "b")]
        streamer.fail_all(RuntimeError("down"))
        assert len(streamer) == 0
        for stream in streams:
            with pytest.raises(RuntimeError, match="down"):
                await stream.get()

    asyncio.run(main())
