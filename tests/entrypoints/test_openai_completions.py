"""/v1/completions through the `openai` SDK and raw HTTP (fake engine echoes prompts)."""

from __future__ import annotations

import openai
import pytest
from openai_helpers import assert_error, sse_events, strict

from flowengine.entrypoints.openai.responses import CompletionResponse


def test_string_prompt(client, http):
    r = client.completions.create(model="fake-model", prompt="abcdef", max_tokens=4, temperature=0)
    assert r.id.startswith("cmpl-") and r.object == "text_completion"
    [choice] = r.choices
    assert (choice.index, choice.text, choice.finish_reason) == (0, "abcd", "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (6, 4, 10)
    raw = http.post("/v1/completions", json={"prompt": "xy", "max_tokens": 3, "temperature": 0})
    assert strict(raw.content, CompletionResponse).choices[0].text == "xyx"


def test_default_max_tokens_is_16(client):
    r = client.completions.create(model="fake-model", prompt="ab", temperature=0)
    assert r.choices[0].text == "ab" * 8 and r.usage.completion_tokens == 16


def test_prompt_forms_and_choice_order(client):
    r = client.completions.create(
        model="fake-model", prompt=["abc", "xyz"], max_tokens=3, temperature=0, n=2
    )
    assert [(c.index, c.text) for c in r.choices] == [
        (0, "abc"),
        (1, "bca"),
        (2, "xyz"),
        (3, "yzx"),
    ]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (6, 12)
    r = client.completions.create(
        model="fake-model", prompt=[104, 105], max_tokens=3, temperature=0
    )
    assert r.choices[0].text == "hih"
    r = client.completions.create(
        model="fake-model", prompt=[[104, 105], [111, 107]], max_tokens=2, temperature=0
    )
    assert [c.text for c in r.choices] == ["hi", "ok"]


def test_echo(client):
    r = client.completions.create(
        model="fake-model", prompt="abc", max_tokens=2, temperature=0, echo=True
    )
    assert r.choices[0].text == "abcab"
    r = client.completions.create(
        model="fake-model", prompt=[104, 105], max_tokens=1, temperature=0, echo=True
    )
    assert r.choices[0].text == "hih"
    chunks = list(
        client.completions.create(
            model="fake-model", prompt="abc", max_tokens=2, temperature=0, echo=True, stream=True
        )
    )
    assert chunks[0].choices[0].text.startswith("abc")
    assert "".join(c.choices[0].text for c in chunks) == "abcab"


def test_logprobs_legacy_format(client):
    r = client.completions.create(
        model="fake-model", prompt="abc", max_tokens=3, temperature=0, logprobs=2
    )
    lp = r.choices[0].logprobs
    assert lp.tokens == ["a", "b", "c"]
    assert lp.token_logprobs == [-0.25, -0.25, -0.25]
    assert lp.top_logprobs == [
        {"a": -0.25, "b": -0.5},
        {"b": -0.25, "c": -0.5},
        {"c": -0.25, "d": -0.5},
    ]
    assert lp.text_offset == [0, 1, 2]
    r = client.completions.create(
        model="fake-model", prompt="abc", max_tokens=2, temperature=0, logprobs=0
    )
    # logprobs 0: each position lists the sampled token (OpenAI's "+1", as vLLM), not
    # None (which read as "no logprob" to clients).
    lp = r.choices[0].logprobs
    assert lp.tokens == ["a", "b"] and lp.token_logprobs == [-0.25, -0.25]
    assert lp.top_logprobs == [{"a": -0.25}, {"b": -0.25}]
    streamed = list(
        client.completions.create(
            model="fake-model", prompt="abc", max_tokens=2, temperature=0, logprobs=0, stream=True
        )
    )
    assert [t for c in streamed for t in c.choices[0].logprobs.top_logprobs] == [
        {"a": -0.25},
        {"b": -0.25},
    ]
    chunks = list(
        client.completions.create(
            model="fake-model", prompt="abc", max_tokens=3, temperature=0, logprobs=1, stream=True
        )
    )
    offsets = [o for c in chunks for o in c.choices[0].logprobs.text_offset]
    assert offsets == [0, 1, 2]


def test_stream_multi_prompt_with_usage(http):
    req = {
        "prompt": ["abc", "xyz"],
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    resp = http.post("/v1/completions", json=req)
    chunks = [strict(p, CompletionResponse) for p in sse_events(resp.content)]
    texts = {0: "", 1: ""}
    finish = {}
    for c in chunks[:-1]:
        assert c.usage is None and len(c.choices) == 1
        texts[c.choices[0].index] += c.choices[0].text
        if c.choices[0].finish_reason:
            finish[c.choices[0].index] = c.choices[0].finish_reason
    assert texts == {0: "abca", 1: "xyzx"} and finish == {0: "length", 1: "length"}
    assert chunks[-1].choices == []
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (6, 8)


def test_stream_continuous_usage_stats_per_choice(http):
    # stream_options.continuous_usage_stats (vLLM's) was silently ignored.
    req = {
        "prompt": ["abc", "wxyz"],
        "max_tokens": 2,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    chunks = [strict(p, CompletionResponse)
              for p in sse_events(http.post("/v1/completions", json=req).content)]
    seen = {0: 0, 1: 0}
    for c in chunks[:-1]:
        [choice] = c.choices
        seen[choice.index] += len(choice.text)
        prompt_len = (3, 4)[choice.index]
        assert (c.usage.prompt_tokens, c.usage.completion_tokens) == (prompt_len,
                                                                      seen[choice.index])
    assert seen == {0: 2, 1: 2}
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (7, 4)


def test_stop_token_ids_and_stop_strings(client):
    r = client.completions.create(
        model="fake-model", prompt="abcd", max_tokens=10, temperature=0,
        extra_body={"stop_token_ids": [ord("c")]},
    )  # fmt: skip
    c = r.choices[0]
    assert (c.text, c.finish_reason, c.model_extra["stop_reason"]) == ("ab", "stop", 99)
    assert r.usage.completion_tokens == 3
    r = client.completions.create(
        model="fake-model", prompt="abcd", max_tokens=10, temperature=0, stop=["da", "cd"]
    )
    assert (r.choices[0].text, r.choices[0].model_extra["stop_reason"]) == ("ab", "cd")


def test_seeded_sampling_is_repeatable(client):
    def sample(seed: int) -> list[str]:
        r = client.completions.create(
            model="fake-model", prompt="abc", max_tokens=12, temperature=0.8, seed=seed, n=2
        )
        return [c.text for c in r.choices]

    first = sample(11)
    assert first == sample(11) and first[0] != first[1]


@pytest.mark.parametrize(
    ("fields", "param", "text"),
    [
        ({"suffix": "x"}, "suffix", "suffix is not supported"),
        ({"best_of": 3}, "best_of", "best_of=3 with n=1"),
        ({"logprobs": -1}, "logprobs", "logprobs=-1 asks for the whole vocabulary"),
        ({"prompt_logprobs": 21}, "prompt_logprobs", "limit of 20 (--max-logprobs)"),
        ({"logprobs": -2}, None, "Expected `int` >= -1"),
        ({"truncate_prompt_tokens": 0}, None, "truncate_prompt_tokens must be >= 1, or -1"),
        ({"allowed_token_ids": []}, None, "allowed_token_ids must be a non-empty list"),
        ({"bad_words": [""]}, None, "bad_words must be a list of non-blank strings"),
        ({"logit_bias": {"5": 101}}, None, "logit_bias[5] must be in [-100, 100]"),
        ({"vllm_xargs": [1]}, None, "Expected `object | null`"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when stream"),
        ({"logit_bias": {"a": 2.0}}, "logit_bias", "logit_bias keys must be token ids"),
        ({"logprobs": 21}, "logprobs", "limit of 20 (--max-logprobs)"),
        ({"prompt": []}, "prompt", "empty list"),
        ({"prompt": ["a", [1]]}, "prompt", "do not mix"),
        ({"top_p": 0}, None, "top_p must be in (0, 1]"),
    ],
)
def test_unsupported_or_invalid_fields_are_400(http, fields, param, text):
    resp = http.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2, **fields})
    err = assert_error(resp, 400, param=param)
    assert text in err["message"]
    assert err["type"] == "invalid_request_error"


def test_sdk_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="fake-model", prompt="abc", suffix="zz")
    assert info.value.status_code == 400 and info.value.param == "suffix"
