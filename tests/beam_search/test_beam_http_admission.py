"""`use_beam_search` over HTTP passes the same admission (`--max-queue-len`) and its
step requests feed the same latency metrics as every other request (the fake engine:
no model)."""

from __future__ import annotations

import re
import sys
import threading
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent.parent / "entrypoints"))
from openai_fake_engine import FakeEngine  # noqa: E402
from openai_helpers import assert_error, wait_until  # noqa: E402
from openai_live_server import LiveServer  # noqa: E402

BEAM = {"prompt": "abc", "max_tokens": 3, "n": 2, "use_beam_search": True}


def _count(metrics: str, name: str) -> int:
    match = re.search(rf"^flowengine:{name}_count{{[^}}]*}} (\S+)$", metrics, re.M)
    assert match is not None, name
    return int(float(match.group(1)))


def _hold_a_seat(http: httpx.Client, admission) -> threading.Thread:
    """Start a plain one-token request in a thread and wait until it holds a seat of the
    queue (it waits for its first token, one fake step); join the thread to end it."""
    first = threading.Thread(target=http.post, args=("/v1/completions",),
                             kwargs={"json": {"prompt": "a", "max_tokens": 1}})
    first.start()
    wait_until(lambda: admission.num_pending == 1, timeout_s=30)
    return first


def test_full_queue_refuses_a_beam_search_and_a_search_holds_a_seat():
    # The first output comes after one slow step: the seat is held that long (the
    # steps are long enough for a loaded machine to send the next request meanwhile).
    engine = FakeEngine(step_s=3.0)
    with LiveServer(engine, max_queue_len=1) as live, \
            httpx.Client(base_url=live.base_url, timeout=60) as http:
        admission = live.server.context.admission
        # A plain request waits for its first token: a beam search is refused.
        first = _hold_a_seat(http, admission)
        assert_error(http.post("/v1/completions", json=BEAM), 429, code="queue_full")
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 2,
                "use_beam_search": True}
        assert_error(http.post("/v1/chat/completions", json=chat), 429, code="queue_full")
        first.join(30)
        wait_until(lambda: admission.num_pending == 0, timeout_s=30)
        engine.step_s = 1.0
        # A beam search's first step holds the seat: a plain request is refused.
        results: list[httpx.Response] = []
        search = threading.Thread(
            target=lambda: results.append(http.post("/v1/completions", json=BEAM)))
        search.start()
        wait_until(lambda: admission.num_pending == 1, timeout_s=30)
        assert_error(http.post("/v1/completions", json={"prompt": "b", "max_tokens": 1}),
                     429, code="queue_full")
        search.join(60)
        assert results[0].status_code == 200, results[0].text
        assert len(results[0].json()["choices"]) == 2
        assert admission.num_pending == 0
        # Two prompts, the queue holds one: no retry could ever pass, so a 400 before
        # any prompt is admitted (eaca2c5; was a 429 after admitting the first).
        resp = http.post("/v1/completions", json={**BEAM, "prompt": ["abc", "xyz"]})
        assert_error(resp, 400, param="prompt")
        assert admission.num_pending == 0 and not engine.running


def test_a_search_refused_midway_gives_its_seat_back():
    """Two prompts, the queue holds two with one taken: the first search is admitted,
    the second refused (429), the first cancelled (its step requests aborted), and its
    seat is given back."""
    engine = FakeEngine(step_s=5.0)  # the plain request holds its seat meanwhile
    with LiveServer(engine, max_queue_len=2) as live, \
            httpx.Client(base_url=live.base_url, timeout=60) as http:
        admission = live.server.context.admission
        first = _hold_a_seat(http, admission)
        resp = http.post("/v1/completions", json={**BEAM, "prompt": ["abc", "xyz"]})
        assert_error(resp, 429, code="queue_full")
        wait_until(lambda: admission.num_pending <= 1, timeout_s=30)  # the search's seat
        first.join(30)
        wait_until(lambda: not engine.running, timeout_s=30)
        assert admission.num_pending == 0


def test_beam_search_feeds_the_latency_metrics():
    engine = FakeEngine(step_s=0.001)
    with LiveServer(engine) as live, httpx.Client(base_url=live.base_url, timeout=60) as http:
        before = http.get("/metrics").text
        resp = http.post("/v1/completions", json=BEAM)
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 2 * 3
        after = http.get("/metrics").text
    # Each step is an engine request (as vLLM's beam search over generate): the first
    # step, then 2 beams x 2 more steps (max_tokens=3): 5 requests, each with one TTFT
    # and one end-to-end latency, as any engine request.
    for name in ("e2e_request_latency_seconds", "time_to_first_token_seconds"):
        assert _count(after, name) - _count(before, name) == 1 + 2 * 2, name

def test_max_tokens_over_the_context_is_lowered_for_beams():
    # max_model_len 12, prompt "abc" (3 byte tokens): 9 tokens of room per beam. A
    # sampled request with the same max_tokens is refused since df5fae2 (vLLM's 400 for
    # a cap that does not fit); the beam route keeps lowering it to the room left.
    engine = FakeEngine(max_model_len=12)
    with LiveServer(engine) as live, httpx.Client(base_url=live.base_url, timeout=60) as http:
        for max_tokens in (10**12, 9, None):
            body = {**BEAM, "max_tokens": max_tokens}
            resp = http.post("/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            choices = resp.json()["choices"]
            assert [c["finish_reason"] for c in choices] == ["length", "length"]
            assert resp.json()["usage"]["completion_tokens"] == 2 * 9
        sampled = http.post("/v1/completions", json={"prompt": "abc", "max_tokens": 10**12})
        assert sampled.status_code == 400, sampled.text
        assert sampled.json()["error"]["param"] == "max_tokens"
        sampled = http.post("/v1/completions", json={"prompt": "abc", "max_tokens": 9})
        assert sampled.json()["usage"]["completion_tokens"] == 9


def test_request_token_cap_counts_the_best_of_beams():
    # --max-request-tokens counts the best_of beams a search runs, not only the n it
    # returns (found by a fresh tester: n=1 with best_of=8 passed a cap of 8 tokens
    # while the search generated 8 beams x 8 tokens).
    from flowengine.entrypoints.openai.sampling import RequestLimits

    limits = RequestLimits(max_request_tokens=16)
    with (
        LiveServer(FakeEngine(), limits=limits) as live,
        httpx.Client(base_url=live.base_url, timeout=60) as http,
    ):
        body = {**BEAM, "n": 1, "best_of": 8, "max_tokens": 8}
        err = assert_error(http.post("/v1/completions", json=body), 400, param="max_tokens")
        assert "may generate 64 tokens (1 prompt(s) x best_of=8 x max_tokens=8)" in (
            err["message"])
        assert "lower best_of or max_tokens" in err["message"]
        ok = http.post("/v1/completions", json={**body, "best_of": 2})  # 2 x 8 = 16
        assert ok.status_code == 200, ok.text
        assert len(ok.json()["choices"]) == 1
