"""SamplingParams validation: every integer within 64 bits, floats finite, no bools as
numbers, each error naming the field and the rule (issue 21 item 1, the `LLM` and
`submit()` side of the edge)."""

from __future__ import annotations

import math

import msgspec
import pytest

from flowengine.sampling_params import INT64_MAX, INT64_MIN, SamplingParams

TOO_BIG = 2**64


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"max_tokens": TOO_BIG}, r"max_tokens must be >= 1 and <= 9223372036854775807"),
        ({"min_tokens": TOO_BIG}, r"min_tokens must be >= 0 and <= 9223372036854775807"),
        ({"seed": TOO_BIG}, r"seed must be in \[-9223372036854775808, 9223372036854775807\]"),
        ({"seed": INT64_MIN - 1}, r"seed must be in"),
        ({"top_k": TOO_BIG}, r"top_k must be -1 or 0 \(disabled\) or >= 1"),
        ({"n": TOO_BIG}, r"n must be an integer >= 1"),
        ({"logprobs": TOO_BIG}, r"logprobs must be >= 0"),
        ({"stop_token_ids": [1, TOO_BIG]}, r"stop_token_ids must be token ids in \[0, "),
        ({"stop_token_ids": [-1]}, r"stop_token_ids must be token ids"),
        ({"stop_token_ids": 5}, r"stop_token_ids must be a list of token ids"),
        ({"n": True}, r"n must be an integer, got True"),
        ({"max_tokens": 2.0}, r"max_tokens must be an integer, got 2.0"),
        ({"seed": "1"}, r"seed must be an integer"),
        ({"temperature": math.inf}, r"temperature must be a finite number, got inf"),
        ({"temperature": math.nan}, r"temperature must be a finite number, got nan"),
        ({"top_p": math.nan}, r"top_p must be a finite number"),
        ({"repetition_penalty": math.inf}, r"repetition_penalty must be a finite number"),
        ({"presence_penalty": True}, r"presence_penalty must be a number, got True"),
        ({"min_p": "0.1"}, r"min_p must be a number"),
        ({"ignore_eos": 1}, r"ignore_eos must be true or false, got 1"),
        ({"stop": 5}, r"stop must be a list of non-empty strings"),
        ({"stop": ["a", ""]}, r"stop must be a list of non-empty strings"),
        ({"min_tokens": 5, "max_tokens": 4}, r"min_tokens must be <= max_tokens \(4\)"),
        ({"seed": INT64_MAX, "n": 2}, r"seed must be <= 9223372036854775807 - \(n - 1\) with n=2"),
    ],
)
def test_out_of_range_or_mistyped_fields_raise_value_error(fields, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**fields)


def test_64_bit_extremes_are_accepted_and_encode_for_the_rings():
    params = SamplingParams(
        max_tokens=INT64_MAX, min_tokens=INT64_MAX, seed=INT64_MIN, top_k=INT64_MAX,
        stop_token_ids=[0, INT64_MAX], logprobs=INT64_MAX, n=INT64_MAX,
    )  # fmt: skip
    assert SamplingParams(seed=INT64_MAX - 3, n=4).seed == INT64_MAX - 3  # samples' seeds fit
    # msgpack (the ring codec) holds every value SamplingParams accepts.
    again = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert again == params
    assert again.seed == INT64_MIN and again.stop_token_ids == [0, INT64_MAX]


def test_tuples_are_taken_as_lists():
    params = SamplingParams(stop=("a", "b"), stop_token_ids=(1, 2))
    assert (params.stop, params.stop_token_ids) == (["a", "b"], [1, 2])


def test_clone_validates_again():
    params = SamplingParams(max_tokens=4)
    assert params.clone(max_tokens=8).max_tokens == 8
    with pytest.raises(ValueError, match="max_tokens"):
        params.clone(max_tokens=TOO_BIG)
