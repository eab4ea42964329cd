"""vLLM's sampling fields on the default model, against transformers (float32) or a
greedy baseline: prompt_logprobs, logprobs=-1, logit_bias, allowed_token_ids,
bad_words, truncate_prompt_tokens, detokenize, extra_args, min_tokens with stop ids.

The engine runs with an 8-token step budget, so every prompt here is prefilled in
chunks and prompt logprobs are collected across steps.
"""

from __future__ import annotations

import msgspec
import pytest
import torch

from flowengine import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox jumps over the lazy dog because it wanted to"


@pytest.fixture(scope="module")
def llm(default_model_path) -> LLM:
    return LLM(default_model_path, max_model_len=512, max_num_batched_tokens=8,
               max_logprobs=-1)


@pytest.fixture(scope="module")
def ref_logprobs(hf_model, tokenizer):
    """prompt ids -> transformers' log_softmax over every position, float64 [P, V]."""

    def run(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            logits = hf_model(torch.tensor([ids])).logits[0]
        return torch.log_softmax(logits.double(), dim=-1)

    return run


def _greedy(llm: LLM, prompt, **kw):
    return llm.generate(prompt, SamplingParams(temperature=0, **kw))[0]


def _free(llm: LLM) -> None:
    s = llm.engine.scheduler
    assert s.num_free_blocks == s.num_total_blocks


def test_prompt_logprobs_match_transformers_across_chunks(llm, ref_logprobs):
    out = _greedy(llm, PROMPT, max_tokens=2, prompt_logprobs=3)
    ids = out.prompt_token_ids
    assert len(ids) > 8  # more than one prefill chunk
    ref = ref_logprobs(ids)
    assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
    for p in range(1, len(ids)):
        entry = out.prompt_logprobs[p]
        tok = ids[p]
        assert entry[tok].logprob == pytest.approx(float(ref[p - 1, tok]), abs=2e-4)
        assert entry[tok].rank == int((ref[p - 1] > ref[p - 1, tok]).sum()) + 1
        top = ref[p - 1].topk(3).indices.tolist()
        assert set(entry) == set(top) | {tok}
        for rank, t in enumerate(top, start=1):
            assert entry[t].rank == rank
        assert entry[tok].decoded_token == llm.tokenizer.decode([tok])
    # The same prompt again: the prefix cache must not swallow the positions.
    again = _greedy(llm, PROMPT, max_tokens=2, prompt_logprobs=0)
    assert [set(e) for e in again.prompt_logprobs[1:]] == [{t} for t in ids[1:]]
    assert [e[t].logprob for e, t in zip(again.prompt_logprobs[1:], ids[1:], strict=True)] \
        == [out.prompt_logprobs[p][ids[p]].logprob for p in range(1, len(ids))]
    assert out.outputs[0].token_ids == again.outputs[0].token_ids
    _free(llm)


def test_prompt_logprobs_once_for_n_samples_and_in_a_stream(llm):
    out = llm.generate(PROMPT, SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=3,
                                              prompt_logprobs=1))[0]
    assert len(out.outputs) == 2 and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    plain = _greedy(llm, PROMPT, max_tokens=3)
    assert plain.prompt_logprobs is None
    _free(llm)


def test_logprobs_minus_one_is_the_whole_vocabulary(llm, ref_logprobs):
    out = _greedy(llm, PROMPT, max_tokens=1, logprobs=-1)
    entry = out.outputs[0].logprobs[0]
    ref = ref_logprobs(out.prompt_token_ids)[-1]
    vocab = llm.resolved.model_config.vocab_size
    assert len(entry) == vocab
    for t in (0, 1, int(ref.argmax()), vocab - 1):
        assert entry[t].logprob == pytest.approx(float(ref[t]), abs=2e-4)


def test_logprobs_minus_one_needs_max_logprobs_minus_one(llm):
    processor = llm.input_processor
    saved = processor.max_logprobs
    processor.max_logprobs = 20
    try:
        with pytest.raises(ValueError, match=r"logprobs=-1 \(the whole vocabulary"):
            llm.generate(PROMPT, SamplingParams(logprobs=-1))
        with pytest.raises(ValueError, match="prompt_logprobs=21 exceeds max_logprobs=20"):
            llm.generate(PROMPT, SamplingParams(prompt_logprobs=21))
    finally:
        processor.max_logprobs = saved


def test_logit_bias_forces_and_bans_tokens(llm, ref_logprobs):
    base = _greedy(llm, PROMPT, max_tokens=4)
    forced = llm.tokenizer.encode(" banana")[0]
    out = _greedy(llm, PROMPT, max_tokens=4, logit_bias={forced: 100.0})
    assert out.outputs[0].token_ids == [forced] * 4
    first = base.outputs[0].token_ids[0]
    ref = ref_logprobs(base.prompt_token_ids)[-1]
    runner_up = int(ref.topk(2).indices[1])
    out = _greedy(llm, PROMPT, max_tokens=1, logit_bias={first: -100.0})
    assert out.outputs[0].token_ids == [runner_up]
    with pytest.raises(ValueError, match="logit_bias has token id"):
        _greedy(llm, PROMPT, logit_bias={10**9: 1.0})
    _free(llm)


def test_allowed_token_ids_pick_the_best_allowed(llm, ref_logprobs, tokenizer):
    allowed = [tokenizer.encode(w)[0] for w in (" cat", " run", " sleep", " eat")]
    ids = tokenizer.encode(PROMPT)
    ref = ref_logprobs(ids)[-1]
    out = _greedy(llm, PROMPT, max_tokens=5, allowed_token_ids=allowed)
    toks = out.outputs[0].token_ids
    assert toks[0] == max(allowed, key=lambda t: float(ref[t]))
    assert set(toks) <= set(allowed)
    with pytest.raises(ValueError, match="allowed_token_ids has token id"):
        _greedy(llm, PROMPT, allowed_token_ids=[10**9])


def test_bad_words_are_never_generated(llm, ref_logprobs):
    base = _greedy(llm, PROMPT, max_tokens=6)
    word = llm.tokenizer.decode(base.outputs[0].token_ids[:1]).strip()
    banned = llm.input_processor.bad_words_token_ids([word])
    singles = {w[0] for w in banned if len(w) == 1}
    assert base.outputs[0].token_ids[0] in singles
    out = _greedy(llm, PROMPT, max_tokens=6, bad_words=[word])
    toks = out.outputs[0].token_ids
    assert not singles & set(toks)
    ref = ref_logprobs(base.prompt_token_ids)[-1].clone()
    ref[list(singles)] = float("-inf")
    assert toks[0] == int(ref.argmax())
    _free(llm)


def test_bad_words_tokenization_follows_vllm(llm, tokenizer):
    words = llm.input_processor.bad_words_token_ids(["hello", " world peace"])
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    expected = [enc("hello")]
    if enc(" hello")[0] != enc("hello")[0] and len(enc(" hello")) == len(enc("hello")):
        expected.append(enc(" hello"))
    expected.append(enc("world peace"))
    if enc(" world peace")[0] != enc("world peace")[0] and \
            len(enc(" world peace")) == len(enc("world peace")):
        expected.append(enc(" world peace"))
    assert words == expected
    assert any(len(w) > 1 for w in words)


def test_multi_token_bad_word_stops_after_its_prefix(llm):
    base = _greedy(llm, PROMPT, max_tokens=6)
    toks = base.outputs[0].token_ids
    # Ban the pair (toks[0], toks[1]) as a bad word given by its ids' text.
    phrase = llm.tokenizer.decode(toks[:2])
    ids = llm.input_processor.bad_words_token_ids([phrase])
    assert toks[:2] in ids
    out = _greedy(llm, PROMPT, max_tokens=6, bad_words=[phrase])
    assert out.outputs[0].token_ids[0] == toks[0]  # the prefix alone is fine
    assert out.outputs[0].token_ids[1] != toks[1]  # its last token is banned after it


def test_truncate_prompt_tokens_keeps_the_last_k(llm, tokenizer):
    full = tokenizer.encode(PROMPT)
    out = _greedy(llm, PROMPT, max_tokens=4, truncate_prompt_tokens=5)
    assert out.prompt_token_ids == full[-5:]
    same = _greedy(llm, {"prompt_token_ids": full[-5:]}, max_tokens=4)
    assert out.outputs[0].token_ids == same.outputs[0].token_ids
    out = _greedy(llm, PROMPT, max_tokens=2, truncate_prompt_tokens=-1)
    assert out.prompt_token_ids == full
    with pytest.raises(ValueError, match="truncate_prompt_tokens=600 is greater than "
                                         "max_model_len=512"):
        _greedy(llm, PROMPT, truncate_prompt_tokens=600)



def test_truncate_prompt_tokens_minus_one_fits_an_over_long_prompt(llm):
    """-1 keeps the last tokens that fit with one generated token (max_model_len - 1);
    it used to keep max_model_len of them, a prompt this engine refuses ("at least one
    token must be generated"), so -1 could never make a long prompt fit."""
    ids = list(range(100, 700))  # 600 tokens, max_model_len 512
    out = _greedy(llm, {"prompt_token_ids": ids}, max_tokens=3, truncate_prompt_tokens=-1)
    assert out.prompt_token_ids == ids[-511:]
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"
    _free(llm)

def test_detokenize_false_gives_ids_only(llm):
    base = _greedy(llm, PROMPT, max_tokens=5, logprobs=1)
    out = _greedy(llm, PROMPT, max_tokens=5, logprobs=1, detokenize=False)
    c = out.outputs[0]
    assert c.text == "" and c.token_ids == base.outputs[0].token_ids
    assert all(lp.decoded_token is None for e in c.logprobs for lp in e.values())
    assert [e[t].logprob for e, t in zip(c.logprobs, c.token_ids, strict=True)] == \
        [e[t].logprob for e, t in zip(base.outputs[0].logprobs, c.token_ids, strict=True)]


def test_extra_args_pass_through_to_the_engine(llm):
    params = SamplingParams(max_tokens=2, extra_args={"tenant": "a", "weights": [1, 2.5]})
    processed = llm.input_processor.process("r1", PROMPT, params)
    child = processed.children[0]
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(child), type=type(child))
    assert wire.sampling_params.extra_args == {"tenant": "a", "weights": [1, 2.5]}
    assert len(llm.generate(PROMPT, params)[0].outputs[0].token_ids) == 2


def test_min_tokens_holds_back_stop_token_ids_and_eos(llm):
    base = _greedy(llm, PROMPT, max_tokens=8)
    toks = base.outputs[0].token_ids
    stop = toks[1]
    short = _greedy(llm, PROMPT, max_tokens=8, stop_token_ids=[stop])
    assert short.outputs[0].token_ids == toks[:2] and short.outputs[0].stop_reason == stop
    held = _greedy(llm, PROMPT, max_tokens=8, stop_token_ids=[stop], min_tokens=4)
    got = held.outputs[0].token_ids
    assert len(got) >= 4 and stop not in got[:4]
    assert got[0] == toks[0]  # before the ban changes anything, the same tokens
    eos = llm.tokenizer.eos_token_id
    hi = [{"role": "user", "content": "Say hi."}]
    chat = llm.chat(hi, SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    assert chat.finish_reason == "stop" and chat.token_ids[-1] == eos
    at_least = len(chat.token_ids) + 3
    longer = llm.chat(hi, SamplingParams(temperature=0, max_tokens=at_least + 2,
                                         min_tokens=at_least))[0].outputs[0]
    assert len(longer.token_ids) >= at_least and eos not in longer.token_ids[:at_least]
    assert longer.token_ids[:len(chat.token_ids) - 1] == chat.token_ids[:-1]
    _free(llm)
