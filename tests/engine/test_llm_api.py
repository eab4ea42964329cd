"""The offline API on the default model: Paris, bad input, n > 1, seeds, stop strings."""

from __future__ import annotations

import pytest

from flowengine import LLM, SamplingParams
from flowengine.beam_search import BeamSearchParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm(default_model_path) -> LLM:
    return LLM(default_model_path, max_model_len=2048)


def _free(llm: LLM) -> None:
    s = llm.engine.scheduler
    assert s.num_free_blocks == s.num_total_blocks


def test_capital_of_france_is_paris(llm):
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=32),
    )
    assert len(out) == 1
    completion = out[0].outputs[0]
    assert "Paris" in completion.text
    assert completion.finish_reason in ("stop", "length")
    _free(llm)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda llm: llm.generate("", SamplingParams()), "empty"),
        (lambda llm: llm.generate("word " * 3000, SamplingParams()), "max_model_len is 2048"),
        (lambda llm: llm.generate("hi", SamplingParams(max_tokens=0)), "max_tokens"),
        (lambda llm: llm.generate("hi", SamplingParams(temperature=-1)), "temperature"),
        (lambda llm: llm.generate("hi", SamplingParams(top_p=0)), "top_p"),
        (lambda llm: llm.generate("hi", SamplingParams(top_p=1.5)), "top_p"),
        (lambda llm: llm.generate("hi", SamplingParams(n=0)), "n must be"),
        (lambda llm: llm.generate([10**9], SamplingParams()), "outside the vocabulary"),
        (lambda llm: llm.generate("hi", SamplingParams(logprobs=100)), "max_logprobs"),
    ],
)
def test_bad_input_is_refused_and_engine_keeps_serving(llm, make, match):
    with pytest.raises(ValueError, match=match):
        make(llm)
    out = llm.generate("The sky is", SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4
    _free(llm)


def test_empty_lists_are_no_work_and_no_outputs(llm, monkeypatch):
    """vLLM's LLM.generate([]) returns []; it was "the prompt is empty". The same for
    chat (no conversations), beam_search, and (before the pooling-runner check)
    nothing is submitted: the request ids do not advance, _run is not called."""
    def no_run(*args, **kwargs):
        raise AssertionError("an empty list started work")

    before = next(llm._ids)
    with monkeypatch.context() as m:
        m.setattr(llm, "_run", no_run)
        assert llm.generate([], SamplingParams(max_tokens=2)) == []
        assert llm.generate([]) == []
        assert llm.chat([], SamplingParams(max_tokens=2)) == []
        assert llm.beam_search([], BeamSearchParams(beam_width=2, max_tokens=2)) == []
    assert next(llm._ids) == before + 1
    with pytest.raises(ValueError, match="empty"):  # an empty prompt is still refused
        llm.generate({"prompt_token_ids": []}, SamplingParams())
    _free(llm)


@pytest.mark.parametrize("prompts", [None, 5, 2.5])
def test_prompts_of_the_wrong_type_are_a_type_error_naming_the_type(llm, prompts):
    """generate(None) raised "object of type 'NoneType' has no len()" from deep inside;
    the error names the argument and the type given."""
    kind = type(prompts).__name__
    with pytest.raises(TypeError, match=f"prompts must be a prompt .* list of them, not {kind}"):
        llm.generate(prompts, SamplingParams(max_tokens=1))
    with pytest.raises(TypeError, match=f"not {kind}"):
        llm.beam_search(prompts, BeamSearchParams(beam_width=2, max_tokens=1))


def test_over_long_prompt_message_states_both_lengths(llm):
    ids = list(range(100, 2200))
    with pytest.raises(ValueError, match=r"the prompt has 2100 tokens, but max_model_len is 2048"):
        llm.generate([{"prompt_token_ids": ids}], SamplingParams())


def test_unknown_keyword_arguments_raise_type_error(default_model_path):
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(default_model_path, max_num_seq=4)
    with pytest.raises(TypeError, match="temprature"):
        SamplingParams(temprature=0.5)


def test_outputs_in_input_order_and_shape(llm):
    prompts = ["One", "Two two", "Three three three"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    assert [o.request_id for o in outs] == sorted((o.request_id for o in outs), key=int)
    for o in outs:
        assert o.finished and len(o.outputs) == 1 and o.outputs[0].index == 0
        assert o.prompt_token_ids == llm.get_tokenizer().encode(o.prompt)


def test_seeded_request_same_alone_and_in_mixed_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate("A story about a cat:", seeded, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm.generate(
        ["Numbers:", "A story about a cat:", "Colors:"],
        [SamplingParams(temperature=1.0, max_tokens=20), seeded, SamplingParams(temperature=0)],
        use_tqdm=False,
    )
    assert mixed[1].outputs[0].token_ids == alone
    _free(llm)


def test_n_samples_share_prompt_blocks(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    out = llm.generate("Write a haiku about the sea:\n" * 8, params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # seeds differ per sample
    assert out.num_cached_tokens == 0
    again = llm.generate("Write a haiku about the sea:\n" * 8, params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    _free(llm)


def test_stop_string_and_stop_token(llm):
    base = llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=20))[0]
    text = base.outputs[0].text
    assert "," in text
    stop_at = text.index(",")
    out = llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=20, stop=[","]))
    c = out[0].outputs[0]
    assert c.text == text[:stop_at] and c.finish_reason == "stop" and c.stop_reason == ","
    out = llm.generate(
        "Count: 1, 2, 3,",
        SamplingParams(temperature=0, max_tokens=20, stop=[","], include_stop_str_in_output=True),
    )
    assert out[0].outputs[0].text == text[: stop_at + 1]
    first = base.outputs[0].token_ids[1]
    out = llm.generate("Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=20,
                                                          stop_token_ids=[first]))
    assert out[0].outputs[0].token_ids == base.outputs[0].token_ids[:2]
    assert out[0].outputs[0].stop_reason == first
    _free(llm)


def test_logprobs_top_n_plus_sampled(llm):
    out = llm.generate("The sky is", SamplingParams(temperature=0, max_tokens=4, logprobs=3))
    c = out[0].outputs[0]
    assert len(c.logprobs) == 4
    for tok, entry in zip(c.token_ids, c.logprobs, strict=True):
        assert tok in entry and entry[tok].rank == 1  # greedy picks the top token
        assert 3 <= len(entry) <= 4
    assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs, strict=True)))
