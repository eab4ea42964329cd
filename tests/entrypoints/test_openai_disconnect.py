"""A client that goes away aborts its engine request (streaming or not) at once."""

from __future__ import annotations

import asyncio

import httpx
import orjson
import pytest
from openai_fake_engine import FakeEngine
from openai_helpers import stream_text, wait_until
from openai_live_server import LiveServer


@pytest.fixture(scope="module")
def slow():
    """A server whose engine takes 10 ms per step (streams last long enough to cut)."""
    engine = FakeEngine(step_s=0.01)
    with LiveServer(engine) as live:
        yield live, engine


def test_streaming_disconnect_aborts(slow):
    live, engine = slow
    req = {"prompt": "abc", "max_tokens": 400, "stream": True}
    with httpx.Client(base_url=live.base_url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=req) as resp:
            lines = resp.iter_lines()
            first = orjson.loads(next(line for line in lines if line)[len("data: ") :])
            next(lines)
    request_id = first["id"]
    wait_until(lambda: request_id in engine.aborted)
    assert request_id in engine.abort_calls and request_id not in engine.running
    wait_until(lambda: live.server.app.num_in_flight == 0)


def test_non_streaming_disconnect_aborts(slow):
    live, engine = slow
    before = len(engine.submitted)
    with httpx.Client(base_url=live.base_url, timeout=0.3) as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    [(request_id, _, _)] = engine.submitted[before:]
    wait_until(lambda: request_id in engine.aborted)
    assert not engine.running


def test_multi_prompt_stream_disconnect_aborts_every_prompt(slow):
    live, engine = slow
    req = {"prompt": ["abc", "xyz"], "max_tokens": 400, "stream": True}
    with httpx.Client(base_url=live.base_url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=req) as resp:
            line = next(line for line in resp.iter_lines() if line)
    base = orjson.loads(line[len("data: ") :])["id"]
    wait_until(lambda: {f"{base}-0", f"{base}-1"} <= set(engine.aborted))
    assert not engine.running


def test_200_streams_get_their_solo_text_and_50_disconnects_abort():
    engine = FakeEngine(step_s=0.01)
    max_tokens = 30

    async def run(base_url: str) -> list[tuple[str, str]]:
        limits = httpx.Limits(max_connections=250, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=base_url, timeout=60, limits=limits) as client:
            # The leavers ask for 400 tokens (4 s of steps), so none can finish on its
            # own before the server sees it leave (with 30, all 50 sometimes finished
            # before their disconnects were read, and nothing was left to abort).
            jobs = [
                stream_text(client, f"p{i:03d}:", 400, 3) if i % 4 == 0
                else stream_text(client, f"p{i:03d}:", max_tokens, None)
                for i in range(200)
            ]
            return await asyncio.gather(*jobs)

    with LiveServer(engine) as live:
        results = asyncio.run(run(live.base_url))
        wait_until(lambda: not engine.running and live.server.app.num_in_flight == 0, 10)
        assert engine.get_stats().num_running == 0
    left = {rid for i, (rid, _) in enumerate(results) if i % 4 == 0}
    for i, (_, text) in enumerate(results):
        if i % 4:
            assert text == (f"p{i:03d}:" * 6)[:max_tokens]  # what it gets when alone
    assert len(left) == 50 and set(engine.aborted) == left
