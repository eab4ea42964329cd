"""Tool calling, structured outputs and reasoning against a live server on the default
model (SmolLM2-135M) with the hermes tool template: `required`, named and `auto`
tool choice, parallel calls, a multi-turn exchange with tool results, streamed
`tool_calls` deltas that join to the non-streamed message, the `openai` SDK's
`parse()`, LangChain's `with_structured_output` and `bind_tools`, and `LLM.chat(tools=)`.
One server for the module, greedy decoding, small max_tokens (the reasoning parser's
live checks are in test_reasoning_live.py: it changes how constraints apply)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from openai_live_server import LiveServer
from pydantic import BaseModel

from flowengine.entrypoints.openai.chat_parsing import ChatParsingOptions

pytestmark = pytest.mark.slow

TEMPLATE = Path(__file__).resolve().parents[2] / "examples/templates/tool_chat_template_hermes.jinja"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather of a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "the city name"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the current time in a time zone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string"}},
                   "required": ["tz"]}}}  # fmt: skip
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
ASK_TWO = [{"role": "user", "content": "What is the weather in Paris and the time in Tokyo?"}]
GREEDY = {"temperature": 0, "max_tokens": 60}


@pytest.fixture(scope="module")
def live(default_model_path):
    from flowengine.entrypoints.async_engine import AsyncEngine

    engine = AsyncEngine(default_model_path, max_model_len=2048, num_kv_blocks=256,
                         chat_template=str(TEMPLATE))  # fmt: skip
    parsing = ChatParsingOptions(tool_call_parser="hermes", enable_auto_tool_choice=True)
    server = LiveServer(engine, manage_engine=True, chat_parsing=parsing).start(timeout_s=600)
    try:
        yield server
    finally:
        server.stop(timeout_s=60)


@pytest.fixture
def client(live):
    return openai.OpenAI(base_url=f"{live.base_url}/v1", api_key="x", max_retries=0, timeout=600)


def _calls(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def _streamed(client, **kwargs):
    """(content, [(name, arguments)], finish_reason) reassembled from the chunks."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for piece in choice.delta.tool_calls or []:
                call = calls.setdefault(piece.index, [None, ""])
                if piece.function.name:
                    assert call[0] is None and piece.id and piece.type == "function"
                    call[0] = piece.function.name
                call[1] += piece.function.arguments or ""
            finish = choice.finish_reason or finish
    return content or None, [tuple(calls[i]) for i in sorted(calls)], finish


def _assert_valid(calls: list[tuple[str, str]]) -> None:
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_required_parallel_calls_parse_and_stream_the_same(client):
    kwargs = dict(model=client.models.list().data[0].id, messages=ASK_TWO,
                  tools=[WEATHER, TIME], tool_choice="required", **GREEDY)  # fmt: skip
    whole = client.chat.completions.create(**kwargs)
    choice = whole.choices[0]
    calls = _calls(choice.message)
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(calls) >= 2  # greedy: both questions get a call
    assert {name for name, _ in calls} == {"get_weather", "get_time"}
    _assert_valid(calls)
    assert _streamed(client, **kwargs) == (None, calls, "tool_calls")
    # parallel_tool_calls=false: the schema allows one call
    single = client.chat.completions.create(**{**kwargs, "parallel_tool_calls": False})
    assert len(_calls(single.choices[0].message)) == 1
    _assert_valid(_calls(single.choices[0].message))


def test_named_function(client):
    kwargs = dict(model=client.models.list().data[0].id, messages=ASK, tools=[WEATHER, TIME],
                  tool_choice={"type": "function", "function": {"name": "get_time"}},
                  **GREEDY)  # fmt: skip
    choice = client.chat.completions.create(**kwargs).choices[0]
    [(name, arguments)] = _calls(choice.message)
    assert name == "get_time" and choice.finish_reason == "stop"  # OpenAI's, for named
    _assert_valid([(name, arguments)])
    assert _streamed(client, **kwargs) == (None, [(name, arguments)], "stop")


def test_auto_passes_text_through_and_multi_turn_with_tool_results(client):
    name = client.models.list().data[0].id
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call-1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "22 C and sunny"},
    ]  # fmt: skip
    auto = client.chat.completions.create(model=name, messages=history, tools=[WEATHER],
                                          temperature=0, max_tokens=24)  # fmt: skip
    none = client.chat.completions.create(model=name, messages=history, tools=[WEATHER],
                                          tool_choice="none", temperature=0, max_tokens=24)
    # The small model answers in text here: auto leaves it as it is (tool_choice none's
    # text); the call parsing of auto is covered with scripted outputs (fake engine).
    assert auto.choices[0].message.content == none.choices[0].message.content
    assert auto.choices[0].message.content
    assert auto.choices[0].finish_reason == none.choices[0].finish_reason
    streamed = _streamed(client, model=name, messages=history, tools=[WEATHER], temperature=0,
                         max_tokens=24)  # fmt: skip
    assert streamed[:2] == (auto.choices[0].message.content, _calls(auto.choices[0].message))


class Capital(BaseModel):
    country: str
    capital: str


def test_openai_sdk_parse(client):
    name = client.models.list().data[0].id
    messages = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]
    parsed = client.chat.completions.parse(model=name, messages=messages, response_format=Capital,
                                           temperature=0, max_tokens=40)  # fmt: skip
    result = parsed.choices[0].message.parsed
    assert isinstance(result, Capital)
    assert Capital.model_validate_json(parsed.choices[0].message.content) == result
    with client.chat.completions.stream(model=name, messages=messages, response_format=Capital,
                                        temperature=0, max_tokens=40) as events:  # fmt: skip
        final = events.get_final_completion()
    assert final.choices[0].message.parsed == result


def test_langchain_structured_output_and_bind_tools(live):
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.tools import tool

    name = httpx.get(f"{live.base_url}/v1/models").json()["data"][0]["id"]
    llm = langchain_openai.ChatOpenAI(base_url=f"{live.base_url}/v1", api_key="x", model=name,
                                      temperature=0, max_tokens=40, max_retries=0,
                                      timeout=600)  # fmt: skip
    question = "What is the capital of France?"
    structured = llm.with_structured_output(Capital)
    answer = structured.invoke(question)
    assert isinstance(answer, Capital)
    assert list(structured.stream(question))[-1] == answer

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather of a city."""
        return "22 C"

    bound = llm.bind_tools([get_weather], tool_choice="get_weather")
    reply = bound.invoke("What is the weather in Paris?")
    [call] = reply.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    total = None
    for chunk in bound.stream("What is the weather in Paris?"):
        total = chunk if total is None else total + chunk
    assert [(c["name"], c["args"]) for c in total.tool_calls] == [(call["name"], call["args"])]


def test_llm_chat_renders_tools(default_model_path, tokenizer):
    from flowengine import LLM, SamplingParams
    from flowengine.tokenize.chat import apply_chat_template, load_chat_template

    llm = LLM(default_model_path, max_model_len=1024, num_kv_blocks=64)
    template = load_chat_template(str(TEMPLATE))
    [out] = llm.chat(ASK, SamplingParams(temperature=0, max_tokens=2), tools=[WEATHER],
                     chat_template=str(TEMPLATE), use_tqdm=False)  # fmt: skip
    assert out.prompt_token_ids == apply_chat_template(tokenizer, ASK, chat_template=template,
                                                       tools=[WEATHER])  # fmt: skip
    assert '"name": "get_weather"' in tokenizer.decode(out.prompt_token_ids)
