"""Issue 21 at the HTTP edge on the real engine, multiproc placement (frontend, engine
and executor processes joined by shared-memory rings), default model:

- item 1: an integer above 64 bits in any integer field is a 400 before anything is
  encoded for the rings, and the server goes on serving (today's main: the encoder's
  OverflowError kills the engine client, every later request is 503);
- item 13: chat logprob `bytes` are each token's raw bytes, also for tokens that hold
  part of a UTF-8 character, so they join into the text's UTF-8.
"""

from __future__ import annotations

import httpx
import pytest
from openai_helpers import assert_error
from openai_live_server import LiveServer

from flowengine.config import EngineArgs

pytestmark = pytest.mark.slow

TOO_BIG = 2**64
CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "hi"}]
# Greedy SmolLM2-135M-Instruct answers this with "日本語" in its first tokens, and its
# byte-level BPE splits those characters across tokens (e.g. "æĹ" + "¥" for 日).
JAPANESE = [{"role": "user", "content": "Write the word 日本語 five times."}]


@pytest.fixture(scope="module")
def live():
    from flowengine.engine.builder import resolve
    from flowengine.entrypoints.async_engine import AsyncEngine

    model_path = resolve(EngineArgs()).model_path
    engine = AsyncEngine(model_path, max_model_len=512, placement="multiproc")
    server = LiveServer(engine, manage_engine=True).start(timeout_s=600)
    try:
        yield server
    finally:
        server.stop(timeout_s=60)


def _normal_request_works(base_url: str) -> None:
    resp = httpx.post(
        f"{base_url}{CHAT}",
        json={"messages": HELLO, "max_tokens": 3, "temperature": 0},
        timeout=120,
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 3
    assert httpx.get(f"{base_url}/health", timeout=30).status_code == 200


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        (CHAT, {"max_tokens": TOO_BIG}, "max_tokens"),
        (CHAT, {"seed": TOO_BIG}, "seed"),
        (CHAT, {"top_k": TOO_BIG}, "top_k"),
        (CHAT, {"priority": TOO_BIG}, "priority"),
        (CHAT, {"stop_token_ids": [TOO_BIG]}, "stop_token_ids[0]"),
        ("/v1/completions", {"prompt": [1, TOO_BIG]}, "prompt[1]"),
        ("/v1/completions", {"n": TOO_BIG}, "n"),
    ],
)
def test_oversized_integer_is_400_and_the_engine_keeps_serving(live, path, fields, param):
    base = {"messages": HELLO} if path == CHAT else {"prompt": "hi"}
    resp = httpx.post(f"{live.base_url}{path}", json={**base, **fields}, timeout=120)
    err = assert_error(resp, 400, param=param)
    assert "922337203685477580" in err["message"]
    _normal_request_works(live.base_url)


def test_chat_logprob_bytes_are_the_tokens_raw_bytes(live):
    resp = httpx.post(
        f"{live.base_url}{CHAT}",
        json={"messages": JAPANESE, "max_tokens": 9, "temperature": 0, "logprobs": True,
              "top_logprobs": 2},
        timeout=120,
    )  # fmt: skip
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    content = choice["message"]["content"]
    assert "日本語" in content
    entries = choice["logprobs"]["content"]
    assert len(entries) == 9
    raw = b"".join(bytes(e["bytes"]) for e in entries)
    assert raw == content.encode()  # the pieces join into the text, byte for byte
    partial = [e for e in entries if _is_partial_utf8(bytes(e["bytes"]))]
    assert partial, "expected tokens holding part of a character"
    for e in partial:
        assert e["bytes"] != list("\ufffd".encode())
    for e in entries:
        for top in e["top_logprobs"]:
            assert isinstance(top["bytes"], list) and top["bytes"]


def _is_partial_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False
