"""Every error is OpenAI's error object with the right status, and the server goes on."""

from __future__ import annotations

import logging
import socket
import threading
import time

import httpx
import openai
import pytest
from openai_fake_engine import FakeEngine
from openai_helpers import API_KEY, MAX_BODY_BYTES, assert_error, sse_events
from openai_live_server import LiveServer

from flowengine.entrypoints.openai.app import AppOptions
from flowengine.errors import RequestTypeError, RequestValidationError
from flowengine.messages import REQUEST_ERROR_PREFIX

CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture(autouse=True)
def still_serving(http):
    """After each error case the server still answers a normal request."""
    yield
    resp = http.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2, "temperature": 0})
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == "ok"


def test_invalid_json(http):
    err = assert_error(http.post(CHAT, content=b'{"messages": [}'), 400, code="invalid_json")
    assert "not valid JSON" in err["message"]
    assert_error(http.post(CHAT, content=b""), 400, code="invalid_json")
    assert_error(http.post(CHAT, content=b"[1, 2]"), 400)
    # A lone surrogate escape: named where it is, not "Input data was truncated".
    body = b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}'
    err = assert_error(http.post(CHAT, content=body), 400, code="invalid_json",
                       param="messages[0].content")
    assert "not valid Unicode text" in err["message"], err["message"]
    err = assert_error(http.post(CHAT, content=b'{"messages": [}'), 400, code="invalid_json")
    assert "Unicode" not in err["message"]


@pytest.mark.parametrize(
    ("body", "param", "text"),
    [
        ({"model": "fake-model"}, "messages", "missing required field `messages`"),
        ({"messages": "hi"}, "messages", "Expected `array`, got `str`"),
        ({"messages": []}, "messages", "length >= 1"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "robot"),
        ({"messages": [{"content": "x"}]}, "messages[0]", "missing required field `role`"),
        ({"messages": HELLO, "max_tokens": "ten"}, "max_tokens", "Expected `int | null`"),
        ({"messages": HELLO, "n": 0}, "n", ">= 1"),
        ({"messages": HELLO, "temperature": -1}, "temperature", ">= 0.0"),
        ({"messages": HELLO, "top_logprobs": 21, "logprobs": True}, "top_logprobs", "<= 20"),
        ({"messages": HELLO, "top_logprobs": 2}, "top_logprobs", "needs logprobs=true"),
        ({"messages": HELLO, "tools": [{"type": "function"}]}, "tools[0]",
         "missing required field `function`"),
        ({"messages": HELLO, "response_format": {"type": "xml"}}, "response_format.type", "xml"),
        ({"messages": HELLO, "guided_regex": "a("}, "guided_regex", "parenthesis is not closed"),
        # Refused by SamplingParams: the field its message starts with is the param.
        ({"messages": HELLO, "top_p": 1.5}, "top_p", "top_p must be in (0, 1]"),
        ({"messages": HELLO, "min_p": 2}, "min_p", "min_p must be in [0, 1]"),
        ({"messages": HELLO, "logit_bias": {"1": 500}}, "logit_bias", "logit_bias[1] must be"),
        ({"messages": HELLO, "min_tokens": 9, "max_tokens": 5}, "min_tokens",
         "min_tokens must be <= max_tokens"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0]",
            "'image_url' is not supported",
        ),
        (  # a text part without its text: say so, not "type 'text' is not supported"
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "messages[0].content[0].text",
            "a text content part needs its text",
        ),
    ],
)
def test_missing_or_mistyped_fields(http, body, param, text):
    err = assert_error(http.post(CHAT, json=body), 400, param=param)
    assert text in err["message"]


ASSISTANT_LAST = [*HELLO, {"role": "assistant", "content": "Hel"}]


@pytest.mark.parametrize(
    ("path", "body", "param", "text"),
    [
        # vLLM's chat fields that change the output: once silently ignored.
        (CHAT, {"messages": ASSISTANT_LAST, "echo": True, "add_generation_prompt": False,
                "continue_final_message": True}, "echo", "echo is not supported yet"),
        (CHAT, {"messages": ASSISTANT_LAST, "echo": True}, "echo", "echo is not supported yet"),
        (CHAT, {"messages": HELLO, "echo": True, "add_generation_prompt": False}, "echo",
         "echo is not supported yet"),
        (CHAT, {"messages": HELLO, "best_of": 3}, "best_of", "best_of=3 with n=1"),
        (CHAT, {"messages": HELLO, "n": 2, "best_of": 3, "use_beam_search": True}, "best_of",
         "best_of=3 with n=2"),
        # Streamed responses carry no prompt log-probabilities (vLLM's 400).
        (CHAT, {"messages": HELLO, "stream": True, "prompt_logprobs": 1}, "prompt_logprobs",
         "not available when `stream=True`"),
        ("/v1/completions", {"prompt": "hi", "stream": True, "prompt_logprobs": 2},
         "prompt_logprobs", "not available when `stream=True`"),
        ("/v1/completions", {"prompt": "hi", "stream": True, "prompt_logprobs": -1},
         "prompt_logprobs", "not available when `stream=True`"),
    ],
)
def test_output_changing_fields_are_refused_not_ignored(http, engine, path, body, param, text):
    before = len(engine.submitted)
    err = assert_error(http.post(path, json={**body, "max_tokens": 2}), 400, param=param)
    assert text in err["message"], err["message"]
    assert len(engine.submitted) == before


@pytest.mark.parametrize(
    ("path", "body"),
    [
        # echo where vLLM has nothing to echo (the answer's role differs from the last
        # message's, or the last message is empty), best_of = n, prompt_logprobs 0.
        (CHAT, {"messages": HELLO, "echo": True}),
        (CHAT, {"messages": [*HELLO, {"role": "assistant", "content": ""}], "echo": True}),
        (CHAT, {"messages": HELLO, "echo": False, "add_generation_prompt": False}),
        (CHAT, {"messages": HELLO, "n": 2, "best_of": 2}),
        (CHAT, {"messages": HELLO, "stream": True, "prompt_logprobs": 0}),
        ("/v1/completions", {"prompt": "hi", "stream": True, "prompt_logprobs": None}),
    ],
)
def test_those_fields_are_served_where_they_change_nothing(http, path, body):
    resp = http.post(path, json={**body, "max_tokens": 2})
    assert resp.status_code == 200, resp.text


def test_unknown_model_is_404_model_not_found(http, client):
    err = assert_error(
        http.post(CHAT, json={"model": "gpt-9", "messages": HELLO}), 404, code="model_not_found"
    )
    assert "'gpt-9' does not exist" in err["message"] and "'fake-model'" in err["message"]
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-9", prompt="x")
    assert info.value.code == "model_not_found"


def test_over_long_prompt_states_limit_and_length(http):
    resp = http.post("/v1/completions", json={"prompt": "a" * 600, "max_tokens": 2})
    err = assert_error(resp, 400)
    assert "600 tokens" in err["message"] and "max_model_len is 512" in err["message"]
    resp = http.post(
        CHAT, json={"messages": [{"role": "user", "content": "a" * 600}], "stream": True}
    )
    assert "max_model_len is 512" in assert_error(resp, 400)["message"]


def test_max_tokens_over_the_context_left_is_400_not_clamped(http):
    # (found by a tester: prompt + max_tokens > max_model_len was silently clamped;
    # vLLM answers 400 with the context length, the prompt's tokens and max_tokens)
    resp = http.post("/v1/completions", json={"prompt": "a" * 500, "max_tokens": 13})
    err = assert_error(resp, 400, param="max_tokens")
    assert err["message"] == (
        "'max_tokens' is too large: 13. This model's maximum context length is 512 tokens "
        "and your request has 500 input tokens (13 > 512 - 500); lower max_tokens to at "
        "most 12 or shorten the prompt"
    )
    fits = http.post("/v1/completions", json={"prompt": "a" * 500, "max_tokens": 12})
    assert fits.status_code == 200 and fits.json()["usage"]["completion_tokens"] == 12
    # Omitted, the default 16 is capped at the context left (12 tokens here).
    default = http.post("/v1/completions", json={"prompt": "a" * 500})
    assert default.status_code == 200 and default.json()["usage"]["completion_tokens"] == 12
    long_chat = [{"role": "user", "content": "a" * 480}]
    for field in ("max_completion_tokens", "max_tokens"):
        for stream in (False, True):
            body = {"messages": long_chat, field: 100, "stream": stream}
            err = assert_error(http.post(CHAT, json=body), 400, param=field)
            assert err["message"].startswith(f"'{field}' is too large: 100. This model's "
                                             "maximum context length is 512 tokens")
    # Unset, a chat answer may take the whole context left.
    resp = http.post(CHAT, json={"messages": long_chat})
    assert resp.status_code == 200 and resp.json()["choices"][0]["finish_reason"] == "length"
    err = assert_error(http.post("/v1/responses", json={"input": "a" * 480,
                                                        "max_output_tokens": 100}),
                       400, param="max_output_tokens")
    assert err["message"].startswith("'max_output_tokens' is too large: 100.")


def test_bad_or_missing_api_key_is_401(server, http):
    for headers in (
        {"authorization": "Bearer wrong"},
        {"authorization": ""},
        {"authorization": API_KEY},
    ):
        resp = httpx.post(f"{server.base_url}{CHAT}", json={"messages": HELLO}, headers=headers)
        assert_error(resp, 401, code="invalid_api_key")
        assert resp.headers["www-authenticate"] == "Bearer"
    bad = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    # Operational routes stay open without a key.
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_unknown_route_404_and_wrong_method_405(http):
    assert_error(http.get("/v1/nothing"), 404, code="not_found")
    assert_error(http.post("/v2/chat/completions", json={}), 404, code="not_found")
    resp = http.get(CHAT)
    assert_error(resp, 405, code="method_not_allowed")
    assert resp.headers["allow"] == "POST"


@pytest.mark.parametrize(("path", "authorized"), [("/v2/nothing", True), (CHAT, False)])
def test_error_before_the_body_arrived_keeps_the_connection(server, path, authorized):
    # The 404/401 is decided from the headers; the body comes in a later packet. The
    # server must still read it, or it closes the connection and the client's next
    # request on it (keep-alive) fails.
    port = int(server.base_url.rsplit(":", 1)[1])
    body = b'{"messages": []}'
    head = f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Length: {len(body)}\r\n"
    if authorized:
        head += f"Authorization: Bearer {API_KEY}\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        reader = sock.makefile("rb")
        sock.sendall(head.encode() + b"\r\n")
        time.sleep(0.2)
        sock.sendall(body)
        expected = b"404" if authorized else b"401"
        assert reader.readline().split()[1] == expected
        _skip_response(reader)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
        assert reader.readline().split()[1] == b"200"


def _skip_response(reader) -> None:
    length = 0
    while (line := reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    reader.read(length)


def test_body_too_large_is_413(http):
    big = {"prompt": "a" * (MAX_BODY_BYTES + 1)}
    resp = http.post("/v1/completions", json=big)
    err = assert_error(resp, 413, code="request_too_large")
    assert str(MAX_BODY_BYTES) in err["message"]
    # The unread rest of the body ends the connection: the answer says so, and the
    # same keep-alive client's next request goes out on a new one.
    assert resp.headers["connection"] == "close"
    assert http.get("/v1/models").status_code == 200

    def chunks():  # no Content-Length: the limit applies while reading
        yield b'{"prompt": "'
        for _ in range(MAX_BODY_BYTES // 1024 + 1):
            yield b"a" * 1024
        yield b'"}'

    assert_error(http.post("/v1/completions", content=chunks()), 413, code="request_too_large")


def test_mid_stream_engine_failure_is_an_error_event_then_done(http, engine):
    engine.fail_after_tokens = 2
    try:
        resp = http.post(CHAT, json={"messages": HELLO, "max_tokens": 5, "stream": True})
        events = sse_events(resp.content)
        assert resp.status_code == 200
        assert events[-1].startswith(b'{"error":')
        assert b'"type":"server_error"' in events[-1] and b"Traceback" not in events[-1]
        assert_error(http.post(CHAT, json={"messages": HELLO, "max_tokens": 5}), 500)
    finally:
        engine.fail_after_tokens = None


def test_engine_error_before_any_output_is_a_status_not_a_stream(http, engine):
    engine.first_output_error = "executor failed: out of memory"
    try:
        resp = http.post(CHAT, json={"messages": HELLO, "max_tokens": 5, "stream": True})
        err = assert_error(resp, 500, code="engine_error")
        assert err["message"] == "executor failed: out of memory"
    finally:
        engine.first_output_error = None


def test_an_error_the_request_caused_in_the_engine_is_a_400(http, engine):
    """An output error marked as the request's own (REQUEST_ERROR_PREFIX: its
    constraints left no token to sample) is answered 400 invalid_request_error, without
    the marker; streamed or not, and on the completions route too."""
    engine.first_output_error = (REQUEST_ERROR_PREFIX + "structured outputs: no token "
                                 "satisfies both the grammar and min_tokens")
    try:
        for stream in (False, True):
            err = assert_error(http.post(CHAT, json={"messages": HELLO, "max_tokens": 5,
                                                     "stream": stream}), 400)
            assert err["type"] == "invalid_request_error"
            assert err["message"] == ("structured outputs: no token satisfies both the "
                                      "grammar and min_tokens")
        assert_error(http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3}), 400)
    finally:
        engine.first_output_error = None


def test_dead_engine_health_503_and_requests_503(http, engine):
    engine.dead = True
    try:
        assert_error(http.get("/health"), 503, code="engine_dead")
        resp = http.post(CHAT, json={"messages": HELLO})
        assert_error(resp, 503, code="engine_dead")
        assert resp.headers["retry-after"] == "1"
    finally:
        engine.dead = False
    assert http.get("/health").status_code == 200


def test_engine_overloaded_is_429_with_retry_after():
    engine = FakeEngine(step_s=0.01, max_running=1)
    with LiveServer(engine) as live, httpx.Client(base_url=live.base_url, timeout=30) as http:
        done = threading.Event()

        def long_request() -> None:
            http.post("/v1/completions", json={"prompt": "abc", "max_tokens": 30})
            done.set()

        threading.Thread(target=long_request).start()
        while not engine.running:
            time.sleep(0.005)
        resp = http.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2})
        assert_error(resp, 429, code="queue_full")
        assert resp.headers["retry-after"] == "2"
        assert done.wait(10)


def test_server_queue_limit_is_429():
    engine = FakeEngine(step_s=0.3)  # the first output comes after one slow step
    with LiveServer(engine, max_queue_len=1) as live:
        with httpx.Client(base_url=live.base_url, timeout=30) as http:
            first = threading.Thread(
                target=http.post,
                args=("/v1/completions",),
                kwargs={"json": {"prompt": "a", "max_tokens": 1}},
            )
            first.start()
            while live.server.context.admission.num_pending == 0:
                time.sleep(0.005)
            resp = http.post("/v1/completions", json={"prompt": "b", "max_tokens": 1})
            assert_error(resp, 429, code="queue_full")
            assert resp.headers["retry-after"] == "1"
            first.join(10)
            assert live.server.context.admission.num_pending == 0


def test_no_cors_headers_by_default(server):
    assert AppOptions().allowed_origins == ()
    resp = httpx.get(f"{server.base_url}/version", headers={"origin": "https://evil.example"})
    assert "access-control-allow-origin" not in resp.headers


def test_more_prompts_than_the_queue_is_400_not_429():
    """A request whose prompts alone outnumber the queue can never be admitted: a 429
    (retry later) would be retried forever, so it is a 400, and nothing is admitted."""
    engine = FakeEngine()
    with LiveServer(engine, max_queue_len=2) as live:
        with httpx.Client(base_url=live.base_url, timeout=30) as http:
            for beam in (False, True):
                body = {"prompt": ["a", "b", "c"], "max_tokens": 1}
                if beam:
                    body |= {"use_beam_search": True, "n": 2}
                resp = http.post("/v1/completions", json=body)
                err = assert_error(resp, 400, param="prompt")
                assert "3 prompts" in err["message"] and "--max-queue-len" in err["message"]
                assert "retry-after" not in resp.headers
            assert engine.submitted == []  # refused before any prompt was admitted
            ok = http.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 1})
            assert ok.status_code == 200 and len(ok.json()["choices"]) == 2
            assert live.server.context.admission.num_pending == 0


def test_responses_text_part_without_text_names_the_missing_text(http):
    body = {"input": [{"role": "user", "content": [{"type": "input_text"}]}]}
    err = assert_error(http.post("/v1/responses", json=body), 400, param="input[0].content[0].text")
    assert "input_text content part needs its text" in err["message"]
    assert "not supported" not in err["message"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("error", "status", "message", "param"), [
    # The request's own fault: 400 with the engine's message (and field).
    (RequestValidationError("bad_field must be positive", param="bad_field"), 400,
     "bad_field must be positive", "bad_field"),
    (RequestTypeError("token-id prompts must be lists of int"), 400,
     "token-id prompts must be lists of int", None),
    (ValueError(REQUEST_ERROR_PREFIX + "structured outputs: no token satisfies the grammar"),
     400, "structured outputs: no token satisfies the grammar", None),
    # A bug inside the engine: 500 with the generic message, nothing internal leaked.
    (TypeError("'NoneType' object is not subscriptable (scheduler.py:123 secret)"), 500,
     "internal server error; see the server log", None),
    (ValueError("block table out of range (kv_cache_manager internals)"), 500,
     "internal server error; see the server log", None),
    (KeyError("req-123"), 500, "internal server error; see the server log", None),
])
def test_engine_exceptions_map_to_400_only_for_request_errors(http, engine, caplog, error,
                                                                status, message, param,
                                                                stream):
    engine.submit_error = error
    try:
        with caplog.at_level(logging.ERROR, logger="flowengine.entrypoints.openai.generation"):
            err = assert_error(http.post(CHAT, json={"messages": HELLO, "max_tokens": 5,
                                                     "stream": stream}), status)
    finally:
        engine.submit_error = None
    assert err["message"] == message
    assert err["param"] == param
    assert err["type"] == ("invalid_request_error" if status == 400 else "server_error")
    logged = [r for r in caplog.records if r.message == "engine request failed"]
    if status == 500:  # the details are in the server log, with the traceback
        assert logged and logged[-1].exc_info is not None
        assert logged[-1].exc_info[1] is error
    else:
        assert not logged
