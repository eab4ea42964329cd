"""vLLM's sampling fields through the `openai` SDK on the real engine and the default
model: echo with logprobs, prompt_logprobs, logprobs/top_logprobs -1, logit_bias,
allowed_token_ids, bad_words, truncate_prompt_tokens, vllm_xargs. References:
transformers' float32 log_softmax and the server's own greedy output."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from openai_helpers import strict
from openai_live_server import LiveServer

from flowengine.config import EngineArgs
from flowengine.entrypoints.openai.responses import ChatCompletionResponse, CompletionResponse
from flowengine.entrypoints.openai.sampling import RequestLimits

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name a color."}]


@pytest.fixture(scope="module")
def model_path() -> str:
    from flowengine.engine.builder import resolve

    return resolve(EngineArgs()).model_path


@pytest.fixture(scope="module")
def live(model_path):
    from flowengine.entrypoints.async_engine import AsyncEngine

    engine = AsyncEngine(model_path, max_model_len=512, max_logprobs=-1)
    server = LiveServer(engine, manage_engine=True, limits=RequestLimits(max_logprobs=-1))
    server.start(timeout_s=600)
    try:
        yield server
    finally:
        server.stop(timeout_s=60)


@pytest.fixture
def client(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.base_url}/v1", api_key="unused", max_retries=0)


def _ref(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].double(), dim=-1)


def test_echo_with_logprobs_puts_the_prompt_first(client, tokenizer, hf_model):
    ids = tokenizer.encode(PROMPT)
    r = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT,
                                  max_tokens=3, temperature=0, echo=True, logprobs=2)
    c = r.choices[0]
    lp = c.logprobs
    assert c.text.startswith(PROMPT)
    assert len(lp.tokens) == len(ids) + 3
    assert lp.tokens[: len(ids)] == [tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = _ref(hf_model, ids)
    for p in range(1, len(ids)):
        assert lp.token_logprobs[p] == pytest.approx(float(ref[p - 1, ids[p]]), abs=2e-4)
        assert len(lp.top_logprobs[p]) in (2, 3)
    assert lp.text_offset[: len(ids)] == [
        len(tokenizer.decode(ids[:p])) for p in range(len(ids))
    ]
    assert lp.text_offset[len(ids)] == len(PROMPT)
    plain = client.completions.create(model=r.model, prompt=PROMPT, max_tokens=3,
                                      temperature=0, logprobs=2)
    assert lp.token_logprobs[len(ids):] == plain.choices[0].logprobs.token_logprobs
    assert c.text == PROMPT + plain.choices[0].text


def test_echo_with_max_tokens_0_is_the_prompt_alone(client, tokenizer):
    # OpenAI's and vLLM's way to score a text (found by a fresh tester: max_tokens 0
    # was a 400 with echo too).
    ids = tokenizer.encode(PROMPT)
    name = client.models.list().data[0].id
    full = client.completions.create(model=name, prompt=PROMPT, max_tokens=3, temperature=0,
                                     echo=True, logprobs=2).choices[0].logprobs
    r = client.completions.create(model=name, prompt=[PROMPT, PROMPT], max_tokens=0,
                                  echo=True, logprobs=2)
    for c in r.choices:
        assert c.text == PROMPT and c.finish_reason == "length"
        assert c.logprobs.tokens == full.tokens[: len(ids)]
        # (batch and prefix-cache numerics: equal to float32 rounding)
        assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
        assert c.logprobs.token_logprobs[1:] == pytest.approx(
            full.token_logprobs[1 : len(ids)], abs=2e-4)
        for top, ref in zip(c.logprobs.top_logprobs[1:], full.top_logprobs[1 : len(ids)],
                            strict=True):
            assert top == pytest.approx(ref, abs=2e-4)
        assert c.logprobs.text_offset == full.text_offset[: len(ids)]
    chunks = list(client.completions.create(model=name, prompt=PROMPT, max_tokens=0,
                                            echo=True, logprobs=2, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == PROMPT
    assert [t for c in chunks for t in c.choices[0].logprobs.tokens] == full.tokens[: len(ids)]
    assert client.completions.create(model=name, prompt=PROMPT, max_tokens=0,
                                     echo=True).choices[0].text == PROMPT
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=name, prompt=PROMPT, max_tokens=0)
    assert err.value.body["param"] == "max_tokens"


def test_prompt_logprobs_field_on_both_routes(client, tokenizer, hf_model):
    ids = tokenizer.encode(PROMPT)
    r = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT,
                                  max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 0})
    plp = r.choices[0].model_extra["prompt_logprobs"]
    ref = _ref(hf_model, ids)
    assert plp[0] is None and len(plp) == len(ids)
    for p in range(1, len(ids)):
        entry = plp[p][str(ids[p])]
        assert entry["logprob"] == pytest.approx(float(ref[p - 1, ids[p]]), abs=2e-4)
        assert entry["rank"] == int((ref[p - 1] > ref[p - 1, ids[p]]).sum()) + 1
        assert entry["decoded_token"] == tokenizer.decode([ids[p]])
    chat = client.chat.completions.create(model=r.model, messages=CHAT, max_tokens=1,
                                          extra_body={"prompt_logprobs": 1})
    plp = chat.model_extra["prompt_logprobs"]
    assert plp[0] is None and all(1 <= len(e) <= 2 for e in plp[1:])
    assert len(plp) == chat.usage.prompt_tokens
    # The documented response shapes hold them (strict decode: no unknown fields).
    body = {"prompt_logprobs": 1, "max_tokens": 1, "echo": True, "logprobs": 0}
    raw = httpx.post(f"{client.base_url}completions", json={"prompt": PROMPT, **body},
                     timeout=120)
    assert strict(raw.content, CompletionResponse).choices[0].prompt_logprobs[0] is None
    raw = httpx.post(f"{client.base_url}chat/completions",
                     json={"messages": CHAT, "prompt_logprobs": 1, "max_tokens": 1}, timeout=120)
    assert strict(raw.content, ChatCompletionResponse).prompt_logprobs[0] is None


def test_minus_one_logprobs_cover_the_vocabulary(client, model_path):
    from flowengine.model.model_config import ModelConfig

    vocab = ModelConfig.from_pretrained(model_path).vocab_size
    chat = client.chat.completions.create(model=client.models.list().data[0].id,
                                          messages=CHAT, max_tokens=1, temperature=0,
                                          logprobs=True, top_logprobs=-1)
    top = chat.choices[0].logprobs.content[0].top_logprobs
    assert len(top) == vocab
    values = [t.logprob for t in top]
    assert values == sorted(values, reverse=True)
    assert chat.choices[0].logprobs.content[0].logprob == values[0]  # greedy: rank 1


def test_logit_bias_allowed_token_ids_and_bad_words(client, tokenizer):
    model = client.models.list().data[0].id
    base = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0)
    forced = tokenizer.encode(" banana")[0]
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0,
                                  logit_bias={str(forced): 100})
    assert r.choices[0].text == tokenizer.decode([forced] * 3)
    allowed = [tokenizer.encode(w)[0] for w in (" big", " small")]
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0,
                                  extra_body={"allowed_token_ids": allowed})
    assert set(tokenizer.encode(r.choices[0].text)) <= set(allowed)
    word = base.choices[0].text.split()[0]
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0,
                                  extra_body={"bad_words": [word]})
    assert word not in r.choices[0].text.split()
    assert r.choices[0].text != base.choices[0].text
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.completions.create(model=model, prompt=PROMPT, max_tokens=1,
                                  extra_body={"allowed_token_ids": [10**9]})
    with pytest.raises(openai.BadRequestError, match=r"logit_bias\[1\] must be in"):
        client.completions.create(model=model, prompt=PROMPT, logit_bias={"1": -101})
    again = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0)
    assert again.choices[0].text == base.choices[0].text  # the server keeps serving


def test_echo_of_a_truncated_prompt_is_what_the_model_saw(client, tokenizer):
    # (found by a fresh tester: the whole request text was echoed while the logprobs
    # listed the kept tokens, their text_offset pointing into the wrong text)
    model = client.models.list().data[0].id
    long = "one two three four five six seven eight nine ten " + PROMPT
    tail = tokenizer.encode(long)[-5:]
    r = client.completions.create(model=model, prompt=long, max_tokens=3, temperature=0,
                                  echo=True, logprobs=0,
                                  extra_body={"truncate_prompt_tokens": 5})
    same = client.completions.create(model=model, prompt=tail, max_tokens=3, temperature=0,
                                     echo=True, logprobs=0)
    c = r.choices[0]
    assert c.text == same.choices[0].text and c.text.startswith(tokenizer.decode(tail))
    assert c.logprobs.tokens == same.choices[0].logprobs.tokens
    assert c.logprobs.text_offset == same.choices[0].logprobs.text_offset
    for token, offset in zip(c.logprobs.tokens, c.logprobs.text_offset, strict=True):
        assert c.text[offset:offset + len(token)] == token


def test_truncate_prompt_tokens_and_vllm_xargs(client, tokenizer):
    model = client.models.list().data[0].id
    long = "one two three four five six seven eight nine ten " + PROMPT
    r = client.completions.create(model=model, prompt=long, max_tokens=3, temperature=0,
                                  extra_body={"truncate_prompt_tokens": 5,
                                              "vllm_xargs": {"tenant": "a", "w": 2}})
    assert r.usage.prompt_tokens == 5
    tail = tokenizer.encode(long)[-5:]
    same = client.completions.create(model=model, prompt=tail, max_tokens=3, temperature=0)
    assert r.choices[0].text == same.choices[0].text
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens=600 is greater"):
        client.chat.completions.create(model=model, messages=CHAT,
                                       extra_body={"truncate_prompt_tokens": 600})
