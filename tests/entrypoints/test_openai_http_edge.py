"""Issue 21's HTTP-edge items on the fake engine: every field range checked before the
engine sees the request, the cap on n, 415 for non-JSON bodies, body and header
timeouts, too-deep JSON, streams cut at the graceful timeout, completions logprobs up
to --max-logprobs, vLLM fields that are not implemented refused by name."""

from __future__ import annotations

import re
import socket
import threading
import time

import httpx
import orjson
import pytest
from openai_fake_engine import FakeEngine
from openai_helpers import API_KEY, assert_error, sse_events
from openai_live_server import LiveServer

from flowengine.entrypoints.openai.app import AppOptions
from flowengine.entrypoints.openai.sampling import RequestLimits
from flowengine.sampling_params import INT64_MAX

CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "hello"}]
TOO_BIG = 2**64  # 18446744073709551616: above every 64-bit integer


@pytest.fixture(autouse=True)
def still_serving(http):
    """After each case the server still answers a normal request."""
    yield
    resp = http.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2, "temperature": 0})
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == "ok"


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        (CHAT, {"max_tokens": TOO_BIG}, "max_tokens"),
        (CHAT, {"max_completion_tokens": TOO_BIG}, "max_completion_tokens"),
        (CHAT, {"seed": TOO_BIG}, "seed"),
        (CHAT, {"seed": -TOO_BIG}, "seed"),
        (CHAT, {"top_k": TOO_BIG}, "top_k"),
        (CHAT, {"priority": TOO_BIG}, "priority"),
        (CHAT, {"stop_token_ids": [1, TOO_BIG]}, "stop_token_ids[1]"),
        (CHAT, {"min_tokens": TOO_BIG}, "min_tokens"),
        (CHAT, {"n": TOO_BIG}, "n"),
        ("/v1/completions", {"max_tokens": TOO_BIG}, "max_tokens"),
        ("/v1/completions", {"logprobs": TOO_BIG}, "logprobs"),
        ("/v1/completions", {"best_of": TOO_BIG}, "best_of"),
        ("/v1/completions", {"prompt": [104, TOO_BIG]}, "prompt[1]"),
        ("/v1/completions", {"prompt": [[104], [TOO_BIG]]}, "prompt[1][0]"),
        ("/detokenize", {"tokens": [TOO_BIG]}, "tokens[0]"),
    ],
)
def test_integers_beyond_64_bits_are_400_before_the_engine(http, engine, path, fields, param):
    base = {"messages": HELLO} if path == CHAT else {"prompt": "abc"}
    if path == "/detokenize":
        base = {}
    num_submitted = len(engine.submitted)
    err = assert_error(http.post(path, json={**base, **fields}), 400, param=param)
    assert "922337203685477580" in err["message"]  # the 64-bit bound it broke
    assert len(engine.submitted) == num_submitted  # refused before anything was encoded


def test_largest_int64_values_are_accepted(http, engine, monkeypatch):
    monkeypatch.setattr(engine, "scheduling_policy", "priority")  # priority is honoured
    body = {"messages": HELLO, "seed": INT64_MAX, "top_k": INT64_MAX, "priority": -(2**63),
            "stop_token_ids": [INT64_MAX], "temperature": 0}
    resp = http.post(CHAT, json=body)
    assert resp.status_code == 200, resp.text
    params = engine.submitted[-1][2]
    assert (params.seed, params.stop_token_ids) == (INT64_MAX, [INT64_MAX])
    # max_tokens INT64_MAX passes the range check but not the context (512 tokens):
    # a 400 naming it, as vLLM (it was clamped before).
    err = assert_error(http.post(CHAT, json={**body, "max_tokens": INT64_MAX}), 400,
                       param="max_tokens")
    assert err["message"].startswith(f"'max_tokens' is too large: {INT64_MAX}.")


@pytest.mark.parametrize(("path", "body"), [
    (CHAT, {"messages": HELLO, "max_tokens": 2, "n": None, "stream": None, "logprobs": None,
            "ignore_eos": None}),
    ("/v1/completions", {"prompt": "abc", "max_tokens": 2, "n": None, "stream": None,
                         "echo": None, "priority": None}),
    ("/v1/responses", {"input": "abc", "max_output_tokens": 2, "store": None,
                       "stream": None}),
])  # fmt: skip
def test_null_fields_take_their_defaults(http, engine, path, body):
    # OpenAI's spec makes stream, n, echo, store, ... nullable and vLLM accepts null for
    # them; they were a 400 "Expected `bool`, got `null`" (found by a fresh tester).
    resp = http.post(path, json={**body, "temperature": 0})
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("application/json")  # not streamed
    params = engine.submitted[-1][2]
    assert (params.n, params.ignore_eos, params.max_tokens) == (1, False, 2)
    # A null where the field has no default is still named.
    err = assert_error(http.post(path, json={**body, "model": None, "top_k": "x"}), 400,
                       param="top_k")
    assert "Expected `int | null`, got `str`" in err["message"]
    doc = http.get("/openapi.json").json()["components"]["schemas"]
    assert {"type": "null"} in doc["CompletionRequest"]["properties"]["stream"]["anyOf"]


@pytest.mark.parametrize(("path", "base"), [
    (CHAT, {"messages": HELLO, "max_tokens": 2}),
    ("/v1/completions", {"prompt": "abc", "max_tokens": 2}),
    ("/v1/responses", {"input": "abc", "max_output_tokens": 2}),
])
def test_priority_under_fcfs_is_400_naming_it(http, engine, path, base):
    """The default --scheduling-policy fcfs ignores priority: a non-zero one is refused
    (vLLM's "Got priority ... but Priority scheduling is not enabled."), 0 is served."""
    num_submitted = len(engine.submitted)
    err = assert_error(http.post(path, json={**base, "priority": 5}), 400,
                       param="priority")
    assert err["message"].startswith("Got priority 5 but Priority scheduling is not enabled")
    assert "--scheduling-policy priority" in err["message"]
    assert len(engine.submitted) == num_submitted
    resp = http.post(path, json={**base, "priority": 0})
    assert resp.status_code == 200, resp.text


def test_non_finite_float_is_400(http):
    body = b'{"messages": [{"role": "user", "content": "x"}], "temperature": 1e999}'
    err = assert_error(
        http.post(CHAT, content=body, headers={"content-type": "application/json"}),
        400,
        param="temperature",
    )
    assert "out of range" in err["message"]


def test_n_over_the_limit_is_400_naming_it(http, engine):
    num_submitted = len(engine.submitted)
    for path, base in ((CHAT, {"messages": HELLO}), ("/v1/completions", {"prompt": "abc"})):
        err = assert_error(http.post(path, json={**base, "n": 10000}), 400, param="n")
        assert "n is 10000" in err["message"] and "limit of 128" in err["message"]
        assert "--max-n" in err["message"]
    assert len(engine.submitted) == num_submitted
    resp = http.post("/v1/completions", json={"prompt": "abc", "n": 128, "max_tokens": 1})
    assert resp.status_code == 200 and len(resp.json()["choices"]) == 128


def test_chat_top_logprobs_over_a_lower_max_logprobs_is_400():
    with LiveServer(FakeEngine(), limits=RequestLimits(max_logprobs=3)) as live:
        body = {"messages": HELLO, "logprobs": True, "top_logprobs": 4, "max_tokens": 1}
        resp = httpx.post(f"{live.base_url}{CHAT}", json=body, timeout=30)
        err = assert_error(resp, 400, param="top_logprobs")
        assert "limit of 3 (--max-logprobs)" in err["message"]
        body["top_logprobs"] = 3
        assert httpx.post(f"{live.base_url}{CHAT}", json=body, timeout=30).status_code == 200


def test_request_token_cap_counts_prompts_n_and_max_tokens():
    limits = RequestLimits(max_n=8, max_request_tokens=40)
    with (
        LiveServer(FakeEngine(), limits=limits) as live,
        httpx.Client(base_url=live.base_url, timeout=30) as http,
    ):
        ok = {"prompt": ["ab", "cd"], "n": 4, "max_tokens": 5}  # 2 x 4 x 5 = 40
        assert http.post("/v1/completions", json=ok).status_code == 200
        err = assert_error(
            http.post("/v1/completions", json={**ok, "max_tokens": 6}), 400, param="max_tokens"
        )
        assert "may generate 48 tokens" in err["message"] and "limit of 40" in err["message"]
        # Chat with max_tokens unset may run to max_model_len (512): 512 > 40.
        err = assert_error(http.post(CHAT, json={"messages": HELLO}), 400, param="max_tokens")
        assert "max_tokens=512" in err["message"]
        err = assert_error(http.post(CHAT, json={"messages": HELLO, "n": 9}), 400, param="n")
        assert "limit of 8" in err["message"]


@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
     "multipart/form-data; boundary=x", "application/xml"],
)  # fmt: skip
def test_non_json_content_type_is_415(http, engine, content_type):
    num_submitted = len(engine.submitted)
    body = orjson.dumps({"messages": HELLO, "max_tokens": 2})
    resp = http.post(CHAT, content=body, headers={"content-type": content_type})
    err = assert_error(resp, 415, code="unsupported_media_type")
    assert "application/json" in err["message"]
    assert len(engine.submitted) == num_submitted


def test_json_content_types_are_accepted(http):
    body = orjson.dumps({"prompt": "ab", "max_tokens": 1})
    for content_type in ("application/json", "application/json; charset=utf-8",
                         "Application/JSON", "application/vnd.api+json"):  # fmt: skip
        resp = http.post("/v1/completions", content=body, headers={"content-type": content_type})
        assert resp.status_code == 200, (content_type, resp.text)


def test_no_content_type_from_a_browser_origin_is_415(http):
    # A Blob body without a type is a "simple" cross-origin request (no preflight).
    body = orjson.dumps({"prompt": "ab", "max_tokens": 1})
    resp = http.post("/v1/completions", content=body, headers={"origin": "https://evil.example"})
    assert_error(resp, 415, code="unsupported_media_type")
    assert http.post("/v1/completions", content=body).status_code == 200  # curl-style


def test_too_deep_json_is_400_without_traceback(http, caplog):
    depth = 30_000  # 60 kB, under the fixture's 64 KiB body limit
    body = b'{"prompt": "ab", "junk": ' + b"[" * depth + b"]" * depth + b"}"
    for path in ("/v1/completions", CHAT, "/tokenize"):
        resp = http.post(path, content=body, headers={"content-type": "application/json"})
        err = assert_error(resp, 400, code="invalid_json")
        assert "too deeply" in err["message"]
    assert "Traceback" not in caplog.text


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        (CHAT, "guided_whitespace_pattern", "[ ]?"),
        (CHAT, "documents", [{"title": "t", "text": "x"}]),
        (CHAT, "mm_processor_kwargs", {"num_crops": 4}),
        (CHAT, "logits_processors", ["pkg.proc"]),
        (CHAT, "kv_transfer_params", {"do_remote_decode": True}),
        (CHAT, "logprobs_mode", "raw_logprobs"),
        ("/v1/completions", "return_token_ids", True),
        ("/v1/completions", "return_tokens_as_token_ids", True),
    ],
)
def test_vllm_fields_not_implemented_are_refused_by_name(http, engine, path, field, value):
    base = {"messages": HELLO} if path == CHAT else {"prompt": "abc"}
    num_submitted = len(engine.submitted)
    err = assert_error(http.post(path, json={**base, field: value}), 400, param=field)
    assert err["message"].startswith(f"{field} is not supported yet")
    assert len(engine.submitted) == num_submitted
    # null is the same as absent
    assert http.post(path, json={**base, field: None, "max_tokens": 1}).status_code == 200


@pytest.mark.parametrize(("path", "default"), [("/v1/completions", True), (CHAT, False)])
def test_add_special_tokens_default_value_is_accepted(http, engine, path, default):
    """vLLM's default add_special_tokens (true on completions, false on chat) is what the
    routes do, so a client that sends it gets the same request as one that leaves it
    out; the other value is not implemented and is refused by name."""
    base = {"messages": HELLO} if path == CHAT else {"prompt": "abc"}
    assert http.post(path, json={**base, "max_tokens": 1}).status_code == 200
    _, plain_prompt, plain_params = engine.submitted[-1]
    assert http.post(path, json={**base, "max_tokens": 1,
                                 "add_special_tokens": default}).status_code == 200
    _, prompt, params = engine.submitted[-1]
    assert (prompt, params.max_tokens) == (plain_prompt, plain_params.max_tokens)
    num_submitted = len(engine.submitted)
    err = assert_error(http.post(path, json={**base, "add_special_tokens": not default}), 400,
                       param="add_special_tokens")
    assert err["message"].startswith("add_special_tokens: only vLLM's default is served")
    assert len(engine.submitted) == num_submitted


def test_response_format_json_schema_with_an_invalid_schema_is_refused(http, engine):
    # (Was: every json_schema refused; structured outputs exist now, tests/structured_outputs.)
    num_submitted = len(engine.submitted)
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}
    err = assert_error(
        http.post(CHAT, json={"messages": HELLO, "response_format": fmt}), 400,
        param="response_format.json_schema.schema",
    )  # fmt: skip
    assert 'Unsupported type "objectx"' in err["message"]
    assert len(engine.submitted) == num_submitted


def test_completions_logprobs_up_to_20(http, client):
    r = client.completions.create(
        model="fake-model", prompt="abc", max_tokens=2, logprobs=20, temperature=0
    )
    tops = r.choices[0].logprobs.top_logprobs
    assert [len(t) for t in tops] == [20, 20]
    assert tops[0]["a"] == -0.25 and min(tops[0].values()) == -0.25 * 20
    err = assert_error(
        http.post("/v1/completions", json={"prompt": "abc", "logprobs": 21}), 400, param="logprobs"
    )
    assert "limit of 20" in err["message"]


def _slow_send(port: int, head: bytes, body: bytes, gap_s: float) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head)
        start = time.monotonic()
        try:
            for i in range(len(body)):
                sock.sendall(body[i : i + 1])
                time.sleep(gap_s)
                if time.monotonic() - start > 20:
                    break
        except OSError:
            pass  # the server closed the connection on us
        sock.settimeout(10)
        data = b""
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except OSError:
            pass
        return data


def test_slow_body_is_cut_with_408():
    options = AppOptions(request_body_timeout_s=1.0)
    with LiveServer(FakeEngine(), app_options=options) as live:
        body = orjson.dumps({"prompt": "abc", "max_tokens": 1})
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        t0 = time.monotonic()
        data = _slow_send(live.port, head, body, gap_s=0.5)
        assert data.split(b"\r\n", 1)[0] == b"HTTP/1.1 408 "
        assert b'"code":"request_timeout"' in data and b"--request-body-timeout" in data
        assert time.monotonic() - t0 < 15  # cut, not held for the 14 s the body takes
        assert httpx.get(f"{live.base_url}/health").status_code == 200


def test_slow_headers_are_cut_by_the_header_timeout():
    with LiveServer(FakeEngine(), header_timeout_s=1.0) as live:
        with socket.create_connection(("127.0.0.1", live.port), timeout=30) as sock:
            t0 = time.monotonic()
            closed = False
            for ch in b"GET /health HTTP/1.1\r\nHost: t\r\nX-Slow: " + b"a" * 40:
                try:
                    sock.sendall(bytes([ch]))
                except OSError:
                    closed = True
                    break
                time.sleep(0.25)
                sock.setblocking(False)
                try:
                    if sock.recv(1) == b"":
                        closed = True
                        break
                except BlockingIOError:
                    pass
                except ConnectionResetError:  # closed with unread bytes queued: an RST
                    closed = True
                    break
                finally:
                    sock.setblocking(True)
            assert closed, "the server held a connection whose headers never ended"
            assert time.monotonic() - t0 < 8


def test_streams_cut_at_the_graceful_timeout_end_with_error_and_done():
    engine = FakeEngine(step_s=0.05)
    live = LiveServer(engine, graceful_timeout_s=0.5).start()
    results: dict[str, bytes] = {}
    started = threading.Event()

    def stream(name: str, path: str, body: dict) -> None:
        with httpx.stream("POST", f"{live.base_url}{path}", json=body, timeout=30) as resp:
            assert resp.status_code == 200
            data = b""
            for chunk in resp.iter_bytes():
                data += chunk
                started.set()
        results[name] = data

    jobs = [
        threading.Thread(target=stream, args=(
            "chat", CHAT, {"messages": HELLO, "max_tokens": 400, "stream": True})),
        threading.Thread(target=stream, args=(
            "completion", "/v1/completions",
            {"prompt": ["ab", "cd"], "max_tokens": 400, "stream": True})),
    ]  # fmt: skip
    for job in jobs:
        job.start()
    assert started.wait(10)
    time.sleep(0.3)
    live.stop()
    for job in jobs:
        job.join(20)
    assert set(results) == {"chat", "completion"}
    for data in results.values():
        events = sse_events(data)  # ends with exactly one data: [DONE]
        err = orjson.loads(events[-1])["error"]
        assert err["code"] == "server_shutdown" and err["type"] == "service_unavailable_error"
        assert b'"finish_reason":"length"' not in data  # really cut short
    assert engine.running == set()  # every engine request was aborted
    assert sorted(engine.aborted)[-3:] and len(engine.aborted) >= 3


def test_unanswered_request_cut_at_the_graceful_timeout_is_503():
    engine = FakeEngine(step_s=0.05)
    live = LiveServer(engine, graceful_timeout_s=0.5).start()
    out: dict[str, httpx.Response] = {}

    def post() -> None:
        out["r"] = httpx.post(
            f"{live.base_url}{CHAT}", json={"messages": HELLO, "max_tokens": 400}, timeout=30
        )

    job = threading.Thread(target=post)
    job.start()
    while not engine.running:
        time.sleep(0.01)
    live.stop()
    job.join(20)
    assert_error(out["r"], 503, code="server_shutdown")
    assert engine.running == set()


def test_second_stop_request_ends_requests_as_the_graceful_timeout_does():
    # A second SIGTERM/SIGINT stopped Hypercorn at once: the unanswered request got an
    # empty 500, the stream stopped mid-body without an error event or [DONE].
    engine = FakeEngine(step_s=0.05)
    live = LiveServer(engine, graceful_timeout_s=60).start()
    out: dict[str, object] = {}
    started = threading.Event()

    def post() -> None:
        out["whole"] = httpx.post(
            f"{live.base_url}{CHAT}", json={"messages": HELLO, "max_tokens": 400}, timeout=30
        )

    def stream() -> None:
        body = {"messages": HELLO, "max_tokens": 400, "stream": True}
        with httpx.stream("POST", f"{live.base_url}{CHAT}", json=body, timeout=30) as resp:
            data = b""
            for chunk in resp.iter_bytes():
                data += chunk
                started.set()
        out["stream"] = data

    jobs = [threading.Thread(target=post), threading.Thread(target=stream)]
    for job in jobs:
        job.start()
    assert started.wait(10)
    while len(engine.running) < 2:
        time.sleep(0.01)
    live.begin_shutdown()
    time.sleep(0.2)
    t0 = time.monotonic()
    live.stop()  # the second stop request
    assert time.monotonic() - t0 < 10
    for job in jobs:
        job.join(20)
    assert_error(out["whole"], 503, code="server_shutdown")
    err = orjson.loads(sse_events(out["stream"])[-1])["error"]  # then exactly one [DONE]
    assert err["code"] == "server_shutdown"
    assert engine.running == set()


def test_api_key_still_checked_before_content_type(server):
    resp = httpx.post(
        f"{server.base_url}{CHAT}", content=b"x", headers={"content-type": "text/plain"}
    )
    assert_error(resp, 401, code="invalid_api_key")
    resp = httpx.post(
        f"{server.base_url}{CHAT}",
        content=b"x",
        headers={"content-type": "text/plain", "authorization": f"Bearer {API_KEY}"},
    )
    assert_error(resp, 415)


def test_default_queue_limit_from_max_num_seqs_is_429_with_retry_after(tmp_path):
    """`flowengine serve` without --max-queue-len: 2 x min(max_num_seqs, KV blocks)
    requests may wait for their first token (the fake engine reports no KV blocks,
    so max_num_seqs 1 gives 2); the third gets 429 with Retry-After."""
    import os
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
        ),
        "FLOWENGINE_TEST_ENGINE": "openai_fake_engine:make_engine",
        "FAKE_ENGINE_STEP_S": "5.0",  # the first output comes after one 5 s step
    }
    log = tmp_path / "server.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "flowengine.entrypoints.cli", "serve", "--port", str(port),
         "--max-num-seqs", "1"],
        env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log.read_text()[-2000:]
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.1)
        body = {"prompt": "ab", "max_tokens": 1}

        def post() -> httpx.Response:
            return httpx.post(f"{base}/v1/completions", json=body, timeout=60)

        def num_running() -> float:
            text = httpx.get(f"{base}/metrics", timeout=10).text
            m = re.search(r"^flowengine:num_requests_running\{[^}]*\} (\S+)$", text, re.M)
            return float(m.group(1)) if m else 0.0

        with ThreadPoolExecutor(2) as pool:
            first = [pool.submit(post) for _ in range(2)]
            # Both admitted; their first output comes only after one 5 s step.
            deadline = time.monotonic() + 4
            while num_running() < 2:
                assert time.monotonic() < deadline, "the two requests were not admitted"
                time.sleep(0.05)
            third = post()
            assert_error(third, 429, code="queue_full")
            assert third.headers["retry-after"] == "1"
            assert "2 requests waiting" in third.json()["error"]["message"]
            assert [f.result().status_code for f in first] == [200, 200]
        assert post().status_code == 200  # room again
    finally:
        proc.terminate()
        proc.wait(30)
    assert "max_queue_len 2 (2 x min(max_num_seqs 1, KV blocks unknown)" in log.read_text()
