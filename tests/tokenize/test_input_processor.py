"""InputProcessor: what a Python caller can pass that HTTP bodies cannot (lone
surrogates, non-int priorities) is refused with a clear error before anything is sent."""

from __future__ import annotations

import pytest

from flowengine.engine.input_processor import (
    REQUESTED_MAX_TOKENS,
    InputProcessor,
    RequestFieldError,
)
from flowengine.sampling_params import SamplingParams


@pytest.fixture(params=["priority"])
def ip(request, fresh_byte_bpe_tokenizer) -> InputProcessor:
    """Under the "priority" policy, unless a test parametrizes `ip` indirectly."""
    tok = fresh_byte_bpe_tokenizer
    return InputProcessor(tok, max_model_len=512, vocab_size=len(tok), eos_token_id=None,
                          chat_template="{% for m in messages %}<{{ m['content'] }}>{% endfor %}",
                          scheduling_policy=request.param)


def test_a_lone_surrogate_is_a_clear_value_error(ip) -> None:
    """A str with a lone surrogate is not Unicode text (JSON bodies cannot carry one,
    Python callers can): a ValueError naming it and its position, for a prompt and for
    chat messages, instead of the fast tokenizer's TypeError."""
    with pytest.raises(ValueError, match=r"the prompt: not valid Unicode text, a lone "
                                         r"surrogate '\\ud800' at character 2"):
        ip.process("r1", "ab\ud800c", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="the chat messages: not valid Unicode text"):
        ip.chat_prompt([{"role": "user", "content": "x\udfff"}])
    text, ids = ip.tokenize("ab c")  # ordinary text: unchanged
    assert text == "ab c" and ids == list(ip.tokenizer.encode("ab c"))


@pytest.mark.parametrize(("priority", "error", "match"), [
    ("x", TypeError, "priority must be an int, not str"),
    (1.5, TypeError, "priority must be an int, not float"),
    (True, TypeError, "priority must be an int, not bool"),
    (2**63, ValueError, "priority must fit a signed 64-bit integer"),
])
def test_a_priority_that_is_not_an_int64_is_refused(ip, priority, error, match) -> None:
    with pytest.raises(error, match=match):
        ip.process("r1", "hi", SamplingParams(max_tokens=2), priority=priority)
    assert ip.process("r1", "hi", SamplingParams(max_tokens=2), priority=-(2**63)).children


@pytest.mark.parametrize("field", ["allowed_token_ids", "logit_bias", "stop_token_ids"])
@pytest.mark.parametrize("offset", [0, 99999999])
def test_a_token_id_outside_the_vocabulary_names_its_field(ip, field, offset) -> None:
    """The HTTP error's `param` is the field (it was null); stop_token_ids are checked
    as vLLM checks them (they were accepted and could never match)."""
    vocab_size = len(ip.tokenizer)
    bad = vocab_size + offset
    value = {bad: 1.0} if field == "logit_bias" else [1, bad]
    with pytest.raises(RequestFieldError, match=rf"^{field} has token id {bad} outside "
                       rf"the vocabulary \[0, {vocab_size}\)") as info:
        ip.process("r1", "hi", SamplingParams(max_tokens=2, **{field: value}))
    assert info.value.param == field
    inside = {vocab_size - 1: 1.0} if field == "logit_bias" else [0, vocab_size - 1]
    assert ip.process("r1", "hi", SamplingParams(max_tokens=2, **{field: inside})).children


@pytest.mark.parametrize("ip", ["fcfs"], indirect=True)
@pytest.mark.parametrize("priority", [1, -1, 2**63 - 1])
def test_a_non_zero_priority_under_fcfs_is_refused(ip, priority) -> None:
    """fcfs ignores priority, so a non-zero one is an error (vLLM's rule), not dropped."""
    with pytest.raises(RequestFieldError, match=f"^Got priority {priority} but Priority "
                       "scheduling is not enabled") as info:
        ip.process("r1", "hi", SamplingParams(max_tokens=2), priority=priority)
    assert info.value.param == "priority"
    assert ip.process("r1", "hi", SamplingParams(max_tokens=2), priority=0).children


def test_ordinary_requests_still_pass(ip) -> None:
    processed = ip.process("r2", "hello", SamplingParams(max_tokens=2, n=2), priority=3)
    assert [c.request_id for c in processed.children] == ["r2-0", "r2-1"]
    assert {c.priority for c in processed.children} == {3}


def test_n_over_the_limit_is_refused_before_any_sample_is_built(ip) -> None:
    """SamplingParams takes any int64 n; fanning out n=10**7 children took minutes and
    17 GB before the engine saw a request. Past MAX_N_SEQUENCES (vLLM's
    VLLM_MAX_N_SEQUENCES default) it is a ValueError naming n."""
    from flowengine.engine.input_processor import MAX_N_SEQUENCES

    too_many = MAX_N_SEQUENCES + 1
    with pytest.raises(ValueError, match=f"n={too_many} exceeds {MAX_N_SEQUENCES}"):
        ip.process("r3", "hello", SamplingParams(max_tokens=2, n=too_many))
    processed = ip.process("r4", "hi", SamplingParams(max_tokens=1, n=MAX_N_SEQUENCES))
    assert len(processed.children) == MAX_N_SEQUENCES


def test_allowed_token_ids_that_leave_nothing_to_sample_are_refused(fresh_byte_bpe_tokenizer):
    """allowed_token_ids=[EOS] with min_tokens=3 (or allowed ids that bad_words all ban)
    masked every logit, and the sampler emitted token 0, outside the allowed set, with
    no error. The contradiction is a ValueError before the request runs."""
    tok = fresh_byte_bpe_tokenizer
    eos, extra = 5, 6
    ip = InputProcessor(tok, max_model_len=512, vocab_size=len(tok), eos_token_id=eos,
                        extra_eos_token_ids=(extra,))
    word_ids = list(tok.encode("a", add_special_tokens=False))
    assert len(word_ids) == 1  # a one-token bad word: always banned
    refused = [
        SamplingParams(allowed_token_ids=[eos], min_tokens=3),
        SamplingParams(allowed_token_ids=[eos, extra, 9], stop_token_ids=[9], min_tokens=1),
        SamplingParams(allowed_token_ids=word_ids, bad_words=["a"]),
        SamplingParams(allowed_token_ids=word_ids + [eos], bad_words=["a"], min_tokens=1),
    ]
    for params in refused:
        with pytest.raises(ValueError, match="allowed_token_ids"):
            ip.process("r5", "hi", params)
    accepted = [
        SamplingParams(allowed_token_ids=[eos], min_tokens=3, ignore_eos=True),
        SamplingParams(allowed_token_ids=[eos, 9], min_tokens=3),
        SamplingParams(allowed_token_ids=[eos]),  # may end at once: that is allowed
    ]
    for params in accepted:
        assert ip.process("r6", "hi", params).children


@pytest.mark.parametrize(("field", "value", "match"), [
    ("n", 0, "n must be an integer >= 1"),
    ("temperature", -1.0, "temperature must be >= 0"),
    ("stop", 5, "stop must be a list of non-empty strings"),
    ("logprobs", -3, "logprobs must be >= 0"),
])
def test_fields_set_after_construction_are_validated_again(ip, field, value, match) -> None:
    """SamplingParams is a mutable struct: a field set after construction skipped its
    check; n = 0 fanned out no sample, and the caller got an IndexError (submit) or
    "1 requests ended without output" (LLM)."""
    params = SamplingParams(max_tokens=2)
    setattr(params, field, value)
    with pytest.raises(ValueError, match=match):
        ip.process("r7", "hi", params)


def test_a_stop_string_set_after_construction_stays_one_string(ip) -> None:
    """sp.stop = "ab" (set, not constructed) was read as the stop strings "a" and "b"."""
    params = SamplingParams(max_tokens=2)
    params.stop = "ab"
    processed = ip.process("r8", "hi", params)
    assert processed.sampling_params.stop == ["ab"]
    assert [c.sampling_params.stop_strings for c in processed.children] == [["ab"]]


def test_a_requested_max_tokens_must_fit_the_context(ip) -> None:
    # The OpenAI routes attach the client's cap; without it max_tokens is capped at
    # the context left (offline LLM, as vLLM's).
    ids = list(range(1, 101))  # 100 prompt tokens, 412 left of 512
    params = SamplingParams(max_tokens=413)
    check = {"param": "max_completion_tokens", "max_tokens": 413}
    with pytest.raises(RequestFieldError) as info:
        ip.process("r", {"prompt_token_ids": ids, REQUESTED_MAX_TOKENS: check}, params)
    assert info.value.param == "max_completion_tokens"
    assert str(info.value).startswith(
        "'max_completion_tokens' is too large: 413. This model's maximum context length "
        "is 512 tokens and your request has 100 input tokens (413 > 512 - 100)")
    fits = {"param": "max_tokens", "max_tokens": 412}
    assert len(ip.process("r", {"prompt_token_ids": ids, REQUESTED_MAX_TOKENS: fits},
                          params).prompt_token_ids) == 100
    assert ip.process("r", ids, params).children  # no check asked: accepted (capped later)
    with pytest.raises(TypeError, match="requested_max_tokens must be"):
        ip.process("r", {"prompt_token_ids": ids, REQUESTED_MAX_TOKENS: {"max_tokens": 1}},
                   params)
