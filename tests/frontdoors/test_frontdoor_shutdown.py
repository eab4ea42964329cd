"""The graceful-shutdown timeout on the front doors: a stream still open is ended with
that API's own terminal event (Responses: response.failed; Anthropic: an `error`
event), an unanswered request gets a 503 in that API's shape, and every engine request
is aborted."""

from __future__ import annotations

import threading
import time

import httpx
import orjson
from openai_fake_engine import FakeEngine
from openai_live_server import LiveServer

USER = [{"role": "user", "content": "hello"}]
SHUTDOWN = "the server is shutting down and its graceful timeout ended this request"


def _events(raw: bytes) -> list[tuple[str, dict]]:
    out = []
    for block in raw.split(b"\n\n")[:-1]:
        head, data = block.split(b"\n")
        assert head.startswith(b"event: ") and data.startswith(b"data: "), block
        out.append((head[len(b"event: ") :].decode(), orjson.loads(data[len(b"data: ") :])))
    return out


def test_streams_and_requests_cut_at_the_graceful_timeout():
    engine = FakeEngine(step_s=0.05)
    live = LiveServer(engine, graceful_timeout_s=0.5).start()
    results: dict[str, httpx.Response | bytes] = {}
    started = threading.Event()

    def stream(name: str, path: str, body: dict) -> None:
        with httpx.stream("POST", f"{live.base_url}{path}", json=body, timeout=30) as resp:
            assert resp.status_code == 200
            data = b""
            for chunk in resp.iter_bytes():
                data += chunk
                started.set()
        results[name] = data

    def post(name: str, path: str, body: dict) -> None:
        results[name] = httpx.post(f"{live.base_url}{path}", json=body, timeout=30)

    jobs = [
        threading.Thread(target=stream, args=(
            "responses", "/v1/responses",
            {"input": "hello", "max_output_tokens": 400, "stream": True})),
        threading.Thread(target=stream, args=(
            "messages", "/v1/messages",
            {"model": "fake-model", "max_tokens": 400, "messages": USER, "stream": True})),
        threading.Thread(target=post, args=(
            "messages_whole", "/v1/messages",
            {"model": "fake-model", "max_tokens": 400, "messages": USER})),
        threading.Thread(target=post, args=(
            "responses_whole", "/v1/responses", {"input": "hello", "max_output_tokens": 400})),
    ]  # fmt: skip
    for job in jobs:
        job.start()
    assert started.wait(10)
    while len(engine.running) < 4:
        time.sleep(0.01)
    live.stop()
    for job in jobs:
        job.join(20)
    assert set(results) == {"responses", "messages", "messages_whole", "responses_whole"}
    # Responses: the stream ends with response.failed, its sequence numbers unbroken.
    events = _events(results["responses"])
    assert events[-1][0] == "response.failed"
    failed = events[-1][1]["response"]
    assert failed["status"] == "failed" and SHUTDOWN in failed["error"]["message"]
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    # Anthropic: the stream ends with an error event in Anthropic's shape.
    events = _events(results["messages"])
    assert events[-1][0] == "error"
    assert events[-1][1]["error"]["type"] == "overloaded_error"
    assert SHUTDOWN in events[-1][1]["error"]["message"]
    assert "message_stop" not in [name for name, _ in events]
    # The unanswered requests: 503 in each API's shape.
    whole = results["messages_whole"]
    assert whole.status_code == 503 and whole.json()["type"] == "error"
    assert whole.json()["error"]["type"] == "overloaded_error"
    whole = results["responses_whole"]
    assert whole.status_code == 503 and whole.json()["error"]["code"] == "server_shutdown"
    assert engine.running == set()
    assert len(engine.aborted) == 4
