"""Pure pieces of the server: error params, logprob formats, admission, routing, flags."""

from __future__ import annotations

import math
import signal
import socket

import msgspec
import pytest

from flowengine.entrypoints.openai import server
from flowengine.entrypoints.openai.errors import APIError, from_decode_error
from flowengine.entrypoints.openai.generation import Admission
from flowengine.entrypoints.openai.logprobs import chat_logprobs, completion_logprobs
from flowengine.entrypoints.openai.protocol import ChatCompletionRequest
from flowengine.entrypoints.openai.router import Route, Router
from flowengine.entrypoints.openai.server import main, make_parser, options_from
from flowengine.outputs import Logprob


class _Tok:
    def decode(self, ids: list[int]) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


def _decode_error(body: bytes) -> APIError:
    with pytest.raises(msgspec.DecodeError) as info:
        msgspec.json.decode(body, type=ChatCompletionRequest)
    return from_decode_error(info.value)


def test_decode_errors_name_the_field():
    assert _decode_error(b"{").code == "invalid_json"
    assert _decode_error(b"{}").param == "messages"
    err = _decode_error(b'{"messages": [{"role": "user", "content": 5}]}')
    assert (err.status, err.param) == (400, "messages[0].content")
    assert err.message == "Expected `str | array | null`, got `int` - at `$.messages[0].content`"


def test_retry_after_rounds_up_to_whole_seconds():
    assert APIError(429, "x", retry_after_s=0.2).headers == {"retry-after": "1"}
    assert APIError(429, "x", retry_after_s=2.5).headers == {"retry-after": "3"}


def test_logprob_formats_clamp_minus_inf_and_order_by_rank():
    entry = {2: Logprob(-math.inf, 3, None), 0: Logprob(-0.5, 1, "a"), 1: Logprob(-1.5, 2, "b")}
    [chat] = chat_logprobs([2], [entry], 2, _Tok())
    assert (chat["token"], chat["logprob"], chat["bytes"]) == ("c", -9999.0, [99])
    assert [(t["token"], t["logprob"]) for t in chat["top_logprobs"]] == [("a", -0.5), ("b", -1.5)]
    legacy = completion_logprobs([2, 0], [entry, entry], 1, _Tok(), text_offset=4)
    assert legacy == {
        "tokens": ["c", "a"],
        "token_logprobs": [-9999.0, -0.5],
        "top_logprobs": [{"a": -0.5, "c": -9999.0}, {"a": -0.5}],
        "text_offset": [4, 5],
    }
    with pytest.raises(ValueError, match="lack the sampled token 7"):
        chat_logprobs([7], [entry], 1, _Tok())
    # logprobs 0: the sampled token alone per position (vLLM's top 0 "+1"), not None.
    legacy = completion_logprobs([2, 1], [entry, entry], 0, _Tok(), text_offset=0)
    assert legacy["top_logprobs"] == [{"c": -9999.0}, {"b": -1.5}]


def test_admission_limit():
    admission = Admission(2)
    admission.enter()
    admission.enter()
    with pytest.raises(APIError) as info:
        admission.enter()
    assert (info.value.status, info.value.code) == (429, "queue_full")
    admission.leave()
    admission.enter()
    assert admission.num_pending == 2
    unlimited = Admission(None)
    for _ in range(1000):
        unlimited.enter()


async def _handler(request):
    raise AssertionError("not called")


def test_router_404_405():
    router = Router([Route("GET", "/a", _handler, "a"), Route("POST", "/a", _handler, "a2")])
    assert router.match("POST", "/a").summary == "a2"
    with pytest.raises(APIError) as info:
        router.match("GET", "/b")
    assert (info.value.status, info.value.code) == (404, "not_found")
    with pytest.raises(APIError) as info:
        router.match("PUT", "/a")
    assert (info.value.status, info.value.headers["allow"]) == (405, "GET, POST")


def test_server_flags(monkeypatch):
    monkeypatch.delenv("FLOWENGINE_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm-env")
    ns = make_parser().parse_args(["m", "--allowed-origins", '["*", "https://x"]'])
    opts = options_from(ns)
    assert (opts.host, opts.port, opts.graceful_timeout_s) == ("127.0.0.1", 8000, 120.0)
    assert opts.app.api_key == "from-vllm-env" and opts.app.allowed_origins == ("*", "https://x")
    monkeypatch.setenv("FLOWENGINE_API_KEY", "from-env")
    assert options_from(make_parser().parse_args([])).app.api_key == "from-env"
    ns = make_parser().parse_args(
        ["--api-key", "flag", "--allowed-origins", "https://a", "https://b"]
    )
    opts = options_from(ns)
    assert opts.app.api_key == "flag" and opts.app.allowed_origins == ("https://a", "https://b")
    assert main(["--max-queue-len", "0"]) == 2
    assert main(["--max-num-seqs", "0"]) == 2


@pytest.mark.parametrize("port", ["-1", "65536", "70000"])
def test_port_out_of_range_is_refused_before_loading(port, caplog):
    # 70000 used to listen on 4464 (the OS takes it modulo 65536), -1 failed only after
    # the model had loaded.
    with caplog.at_level("ERROR", logger="flowengine.entrypoints.openai.server"):
        assert main(["--port", port]) == 2
    assert [r.getMessage() for r in caplog.records] == [
        f"--port must be in [0, 65535], got {port}"]


def test_bad_json_list_names_its_cors_flag(caplog):
    # Was orjson's bare "unexpected character, expected a JSON value: line 1 column 2".
    with caplog.at_level("ERROR", logger="flowengine.entrypoints.openai.server"):
        assert main(["--allowed-origins", "[bad"]) == 2
    [message] = [r.getMessage() for r in caplog.records]
    assert message.startswith("--allowed-origins '[bad' is not a JSON list: ")


def test_port_in_use_is_refused_before_loading(monkeypatch, caplog):
    # vLLM binds before loading too: the error came only after the model had loaded.
    def create_engine(*args: object) -> None:
        raise AssertionError("the model was loaded before the port was bound")

    monkeypatch.setattr(server, "create_engine", create_engine)
    monkeypatch.setattr(signal, "signal", lambda *args: None)  # keep pytest's SIGINT
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with caplog.at_level("ERROR", logger="flowengine.entrypoints.openai.server"):
            assert main(["--port", str(port)]) == 1
    [message] = [r.getMessage() for r in caplog.records]
    assert message.startswith(f"cannot listen on 127.0.0.1:{port}: [Errno 98]")
