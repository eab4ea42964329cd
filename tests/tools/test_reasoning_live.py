"""`--reasoning-parser qwen3` against a live server on the default model: the streamed
and non-streamed reasoning/content split are equal, and a JSON constraint applies
only after the think block (the model may reason first, the content still parses)."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from openai_live_server import LiveServer

from flowengine.entrypoints.openai.chat_parsing import ChatParsingOptions

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {"capital": {"type": "string"}},
          "required": ["capital"], "additionalProperties": False}  # fmt: skip


@pytest.fixture(scope="module")
def live(default_model_path):
    from flowengine.entrypoints.async_engine import AsyncEngine

    engine = AsyncEngine(default_model_path, max_model_len=1024, num_kv_blocks=128)
    server = LiveServer(engine, manage_engine=True,
                        chat_parsing=ChatParsingOptions(reasoning_parser="qwen3"))  # fmt: skip
    server.start(timeout_s=600)
    try:
        yield server
    finally:
        server.stop(timeout_s=60)


def _stream_split(http: httpx.Client, body: dict) -> tuple[str | None, str | None]:
    raw = http.post("/v1/chat/completions", json={**body, "stream": True}).text
    reasoning = content = ""
    for event in raw.split("\n\n"):
        if event.startswith("data: {"):
            for choice in json.loads(event[6:])["choices"]:
                reasoning += choice["delta"].get("reasoning_content") or ""
                content += choice["delta"].get("content") or ""
    return reasoning or None, content or None


def test_reasoning_split_live(live):
    # The prompt opens the think block (an assistant turn continued from "<think>\n"),
    # so the qwen3 parser reads the output as reasoning until </think>.
    body = {"messages": [{"role": "user", "content": "What is the capital of France?"},
                         {"role": "assistant", "content": "<think>\n"}],
            "add_generation_prompt": False, "continue_final_message": True,
            "temperature": 0, "max_tokens": 16}  # fmt: skip
    with httpx.Client(base_url=live.base_url, timeout=600) as http:
        whole = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert whole["reasoning_content"]
        assert _stream_split(http, body) == (whole["reasoning_content"], whole["content"] or None)


def test_json_constraint_applies_after_reasoning(live):
    body = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
            "response_format": {"type": "json_schema",
                                 "json_schema": {"name": "answer", "schema": SCHEMA}},
            "temperature": 0, "max_tokens": 80}  # fmt: skip
    with httpx.Client(base_url=live.base_url, timeout=600) as http:
        choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
        message = choice["message"]
        if choice["finish_reason"] == "stop":  # the grammar let it end: the JSON is whole
            assert set(json.loads(message["content"])) == {"capital"}
        else:  # cut by max_tokens: the model reasoned first, which the constraint allows
            assert choice["finish_reason"] == "length" and message["reasoning_content"]
        assert _stream_split(http, body) == (message.get("reasoning_content"),
                                             message["content"] or None)  # fmt: skip




# Few-shot turns that reason in a think block first: the default model imitates them.
SHOTS = [{"role": "user", "content": "What is 2 + 2?"},
         {"role": "assistant", "content": "<think>Two plus two is four.</think>4"},
         {"role": "user", "content": "What is the capital of Italy?"},
         {"role": "assistant", "content": "<think>Italy's capital city is Rome.</think>Rome"},
         {"role": "user", "content": "What is 10 + 5?"},
         {"role": "assistant", "content": "<think>Ten plus five is fifteen.</think>15"}]  # fmt: skip
SUM_EBNF = 'root ::= num (" + " num)*\nnum ::= [1-9] [0-9]*'


@pytest.mark.parametrize(
    ("question", "constraint", "content_re"),
    [
        ("What is 12 + 30?", {"structured_outputs": {"regex": "[0-9]{1,3}"}}, r"[0-9]{1,3}"),
        ("What is the capital of France?", {"guided_choice": ["Paris", "London", "Rome"]},
         r"Paris|London|Rome"),
        ("Write a sum of two numbers.", {"guided_grammar": SUM_EBNF},
         r"[1-9][0-9]*( \+ [1-9][0-9]*)*"),
    ],
    ids=["regex", "choice", "grammar"],
)
def test_regex_choice_and_grammar_apply_after_reasoning(live, question, constraint, content_re):
    # The model reasons first (free text no constraint would allow), then the content is
    # exactly in the constraint's language; streamed and non-streamed splits are equal.
    body = {"messages": [*SHOTS, {"role": "user", "content": question}],
            "temperature": 0, "max_tokens": 60, **constraint}  # fmt: skip
    with httpx.Client(base_url=live.base_url, timeout=600) as http:
        choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
        message = choice["message"]
        assert choice["finish_reason"] == "stop", choice
        assert message["reasoning_content"] and not re.fullmatch(content_re,
                                                                 message["reasoning_content"])
        assert re.fullmatch(content_re, message["content"]), message
        assert _stream_split(http, body) == (message["reasoning_content"], message["content"])
