"""OutputProcessor: engine deltas -> RequestOutputs, streamed and cumulative."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from flowengine.engine.input_processor import ProcessedPrompt
from flowengine.engine.output_processor import OutputProcessor
from flowengine.messages import NewRequest, RequestDelta, TokenLogprobs
from flowengine.sampling_params import SamplingParams
from flowengine.tokenize.decode_table import bytes_to_unicode

EOS = 256


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    """Byte-level BPE without merges: token id = byte value, EOS = 256."""
    chars = bytes_to_unicode()
    backend = Tokenizer(models.BPE({chars[b]: b for b in range(256)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")
    assert tokenizer.eos_token_id == EOS
    return tokenizer


def ids(text: str) -> list[int]:
    return list(text.encode())


def prompt(request_id: str, params: SamplingParams) -> ProcessedPrompt:
    prompt_ids = ids("Q: ")
    children = [
        NewRequest(request_id if params.n == 1 else f"{request_id}-{i}", prompt_ids, params, 0.0)
        for i in range(params.n)
    ]
    return ProcessedPrompt(request_id, "Q: ", prompt_ids, params, children)


PARAMS = SamplingParams(max_tokens=16)


def test_stream_outputs_carry_deltas_and_finish_last(tok) -> None:
    op = OutputProcessor(tok, stream=True)
    op.add_request(prompt("a", PARAMS))
    op.add_request(prompt("b", PARAMS))
    é = ids("é")  # two bytes: the first alone is half a character
    outs, stop = op.process([RequestDelta("a", ids("hi")), RequestDelta("b", é[:1])])
    assert stop == []
    assert [(o.request_id, o.outputs[0].text, o.outputs[0].token_ids) for o in outs] == [
        ("a", "hi", ids("hi")),
        ("b", "", é[:1]),
    ]
    assert not any(o.finished for o in outs)
    outs, _ = op.process([RequestDelta("b", é[1:], finish_reason="length")])
    (out,) = outs
    assert (out.outputs[0].text, out.outputs[0].token_ids) == ("é", é[1:])
    assert out.finished and out.outputs[0].finish_reason == "length"
    assert out.prompt == "Q: " and out.prompt_token_ids == ids("Q: ")
    assert "b" not in op and "a" in op
    assert op.process([RequestDelta("b", ids("x"))]) == ([], [])  # forgotten


def test_two_deltas_in_one_batch_make_one_output(tok) -> None:
    op = OutputProcessor(tok, stream=True)
    op.add_request(prompt("a", PARAMS))
    first, second = RequestDelta("a", ids("ab")), RequestDelta("a", ids("c"))
    (out,), _ = op.process([first, second])
    assert (out.outputs[0].text, out.outputs[0].token_ids) == ("abc", ids("abc"))
    assert first.new_token_ids == ids("ab") and second.new_token_ids == ids("c")
    (out,), _ = op.process([RequestDelta("a", ids("d"))])
    assert out.outputs[0].token_ids == ids("d")


def test_cumulative_outputs_when_not_streaming(tok) -> None:
    op = OutputProcessor(tok, stream=False)
    op.add_request(prompt("a", PARAMS))
    (out1,), _ = op.process([RequestDelta("a", ids("he"))])
    (out2,), _ = op.process([RequestDelta("a", ids("llo"), finish_reason="length")])
    assert (out1.outputs[0].text, out1.outputs[0].token_ids) == ("he", ids("he"))
    assert (out2.outputs[0].text, out2.outputs[0].token_ids) == ("hello", ids("hello"))
    assert out2.finished and len(op) == 0


def test_final_only_returns_finished_requests(tok) -> None:
    op = OutputProcessor(tok, final_only=True)
    op.add_request(prompt("a", PARAMS))
    op.add_request(prompt("b", SamplingParams(n=2, max_tokens=16)))
    assert op.process([RequestDelta("a", ids("he")), RequestDelta("b-0", ids("x"))]) == ([], [])
    outs, _ = op.process(
        [RequestDelta("a", ids("y"), finish_reason="length"), RequestDelta("b-1", ids("z"))]
    )
    assert [(o.request_id, o.outputs[0].text, o.outputs[0].token_ids) for o in outs] == [
        ("a", "hey", ids("hey"))
    ]
    (out,), _ = op.process([RequestDelta("b-0", [], finish_reason="abort"),
                            RequestDelta("b-1", [], finish_reason="length")])  # fmt: skip
    assert [(c.text, c.finish_reason) for c in out.outputs] == [("x", "abort"), ("z", "length")]
    assert out.finished and len(op) == 0
    with pytest.raises(ValueError, match="pass stream=False"):
        OutputProcessor(tok, stream=True, final_only=True)


def test_eos_text_is_left_out(tok) -> None:
    op = OutputProcessor(tok, stream=True)
    op.add_request(prompt("a", PARAMS))
    (out,), _ = op.process([RequestDelta("a", [*ids("ok"), EOS], finish_reason="stop")])
    assert out.outputs[0].text == "ok" and out.outputs[0].token_ids == [*ids("ok"), EOS]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason is None


def test_stop_string_finishes_and_asks_to_stop_the_engine(tok) -> None:
    op = OutputProcessor(tok, stream=True)
    op.add_request(prompt("a", SamplingParams(max_tokens=16, stop=["END"])))
    (out,), stop = op.process([RequestDelta("a", ids("xE"))])
    assert out.outputs[0].text == "x" and stop == []  # "E" may start "END": held back
    (out,), stop = op.process([RequestDelta("a", ids("ND!"))])
    assert out.outputs[0].text == "" and out.finished
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", "END")
    assert stop == ["a"] and len(op) == 0


def test_n2_streams_only_changed_samples_and_finishes_with_the_last(tok) -> None:
    op = OutputProcessor(tok, stream=True)
    op.add_request(prompt("r", SamplingParams(n=2, max_tokens=16)))
    assert op.child_ids("r") == ["r-0", "r-1"]
    (out,), _ = op.process([RequestDelta("r-1", ids("b"), num_cached_tokens=3)])
    assert [(c.index, c.text) for c in out.outputs] == [(1, "b")]
    assert out.num_cached_tokens == 0  # counted from sample 0 only
    (out,), _ = op.process(
        [RequestDelta("r-0", ids("a"), finish_reason="length", num_cached_tokens=3)]
    )
    assert [(c.index, c.text, c.finish_reason) for c in out.outputs] == [(0, "a", "length")]
    assert not out.finished and out.num_cached_tokens == 3
    (out,), _ = op.process([RequestDelta("r-1", ids("c"), finish_reason="length")])
    assert [(c.index, c.text) for c in out.outputs] == [(1, "c")] and out.finished
    assert len(op) == 0


def test_logprobs_and_error(tok) -> None:
    op = OutputProcessor(tok, stream=True)
    op.add_request(prompt("a", SamplingParams(max_tokens=16, logprobs=1)))
    lp = TokenLogprobs(top_token_ids=[ord("x")], top_logprobs=[-0.5], sampled_logprob=-1.5,
                       sampled_rank=2)  # fmt: skip
    (out,), _ = op.process([RequestDelta("a", ids("y"), new_logprobs=[lp])])
    (completion,) = out.outputs
    assert completion.cumulative_logprob == -1.5
    (entry,) = completion.logprobs
    assert {t: (v.logprob, v.rank, v.decoded_token) for t, v in entry.items()} == {
        ord("x"): (-0.5, 1, "x"),
        ord("y"): (-1.5, 2, "y"),
    }
    (out,), _ = op.process([RequestDelta("a", [], finish_reason="error", error="boom")])
    assert out.error == "boom" and out.finished and out.outputs[0].logprobs == []


def test_resubmit_carries_delivered_tokens(tok) -> None:
    op = OutputProcessor(tok, stream=True)
    op.add_request(prompt("a", PARAMS))
    op.process([RequestDelta("a", ids("ab"))])
    op.process([RequestDelta("a", ids("c"))])
    (msg,) = op.resubmit_requests()
    assert msg.request_id == "a" and msg.output_token_ids == ids("abc")
    assert op.abort("a") == ["a"] and len(op) == 0


def _plp(top: int, value: float) -> TokenLogprobs:
    return TokenLogprobs(top_token_ids=[top], top_logprobs=[value - 1.0],
                         sampled_logprob=value, sampled_rank=2)


@pytest.mark.parametrize("stream", [True, False])
def test_prompt_logprobs_none_first_then_one_entry_per_prompt_token(tok, stream) -> None:
    op = OutputProcessor(tok, stream=stream)
    op.add_request(prompt("p", SamplingParams(max_tokens=4, prompt_logprobs=1)))
    q, colon, space = ids("Q: ")
    delta = RequestDelta("p", ids("a"), prompt_logprobs=[_plp(7, -0.5), _plp(8, -1.5)])
    (out,), _ = op.process([delta])
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == 3
    first, second = out.prompt_logprobs[1:]
    assert set(first) == {7, colon} and first[colon].logprob == -0.5 and first[colon].rank == 2
    assert first[7].logprob == -1.5 and first[7].rank == 1 and first[7].decoded_token == "\x07"
    assert second[space].logprob == -1.5 and second[space].decoded_token == " "
    (later,), _ = op.process([RequestDelta("p", ids("b"), finish_reason="length")])
    # A stream sends them once (with the first output); cumulative outputs keep them.
    assert (later.prompt_logprobs is None) if stream else (later.prompt_logprobs == out.prompt_logprobs)


def test_detokenize_false_gives_no_text(tok) -> None:
    op = OutputProcessor(tok)
    op.add_request(prompt("d", SamplingParams(max_tokens=4, detokenize=False, logprobs=0)))
    lp = TokenLogprobs(top_token_ids=[], top_logprobs=[], sampled_logprob=-0.1, sampled_rank=1)
    (out,), _ = op.process([RequestDelta("d", ids("hi"), [lp, lp], finish_reason="length")])
    c = out.outputs[0]
    assert (c.text, c.token_ids, c.finish_reason) == ("", ids("hi"), "length")
    assert [e[t].decoded_token for e, t in zip(c.logprobs, c.token_ids, strict=True)] == [None, None]


def test_a_sample_id_taken_by_another_request_is_refused(tok) -> None:
    """Sample i of request R is "R-i" in the engine when n > 1: a request named like a
    live request's sample (or one whose samples are named like a live request) is
    refused, in either order; before, both were registered and the first one's sample
    outputs went to the other, so its caller waited forever."""
    two = SamplingParams(max_tokens=4, n=2)
    op = OutputProcessor(tok, stream=True)
    op.add_request(prompt("a", two))
    with pytest.raises(ValueError, match="'a-1' is already in use by request 'a'"):
        op.add_request(prompt("a-1", PARAMS))
    op = OutputProcessor(tok, stream=True)
    op.add_request(prompt("a-1", PARAMS))
    with pytest.raises(ValueError, match="'a-1' is already in use by request 'a-1'"):
        op.add_request(prompt("a", two))
    assert "a" not in op and len(op) == 1  # nothing of the refused request was kept
    op.add_request(prompt("a-0", PARAMS))  # no clash: accepted
    outs, _ = op.process([RequestDelta("a-1", ids("x"), finish_reason="length")])
    assert [o.request_id for o in outs] == ["a-1"]


@pytest.mark.parametrize("stream", [True, False])
def test_stream_interval_sends_first_every_n_and_last(tok, stream) -> None:
    """--stream-interval 3: the first token at once, then an output once 3 tokens are
    unsent, and the finish at once; the text and ids the caller assembles are the same
    as with interval 1 (DELTA), or the latest snapshot is (CUMULATIVE)."""
    op = OutputProcessor(tok, stream=stream, stream_interval=3)
    op.add_request(prompt("a", PARAMS))
    sent = []
    for i, ch in enumerate("abcdefgh"):
        outs, _ = op.process([RequestDelta("a", ids(ch),
                                           finish_reason="length" if i == 7 else None)])
        sent.append([(o.outputs[0].text, o.outputs[0].token_ids, o.finished) for o in outs])
    if stream:
        assert sent == [[("a", ids("a"), False)], [], [], [("bcd", ids("bcd"), False)], [], [],
                        [("efg", ids("efg"), False)], [("h", ids("h"), True)]]
    else:
        assert sent == [[("a", ids("a"), False)], [], [], [("abcd", ids("abcd"), False)], [], [],
                        [("abcdefg", ids("abcdefg"), False)],
                        [("abcdefgh", ids("abcdefgh"), True)]]
    assert len(op) == 0


def test_stream_interval_counts_tokens_per_sample_and_sends_a_finished_sample(tok) -> None:
    op = OutputProcessor(tok, stream=True, stream_interval=2)
    op.add_request(prompt("r", SamplingParams(n=2, max_tokens=16)))
    (out,), _ = op.process([RequestDelta("r-0", ids("a"))])  # the request's first output
    assert [(c.index, c.text) for c in out.outputs] == [(0, "a")]
    assert op.process([RequestDelta("r-1", ids("x"))]) == ([], [])  # 1 unsent of 2
    (out,), _ = op.process([RequestDelta("r-0", ids("bc"))])  # two at once: due
    assert [(c.index, c.text) for c in out.outputs] == [(0, "bc"), (1, "x")]
    (out,), _ = op.process([RequestDelta("r-1", ids("y"), finish_reason="length")])
    assert [(c.index, c.text, c.finish_reason) for c in out.outputs] == [(1, "y", "length")]
    assert not out.finished
    assert op.process([RequestDelta("r-0", ids("d"))]) == ([], [])
    (out,), _ = op.process([RequestDelta("r-0", ids("e"), finish_reason="length")])
    assert [(c.index, c.text) for c in out.outputs] == [(0, "de")] and out.finished


def test_stream_interval_below_one_is_refused(tok) -> None:
    with pytest.raises(ValueError, match="stream_interval"):
        OutputProcessor(tok, stream=True, stream_interval=0)
