"""Sampler: logit_bias, allowed_token_ids, bad_words and logprobs=-1, exact effects.

Logits are fresh random values each run; expected tokens are computed by hand from
them (argmax of the edited row), so every check has one right answer.
"""

from __future__ import annotations

import pytest
import torch

from flowengine.sample.metadata import SamplingMetadata, SamplingState
from flowengine.sample.sampler import Sampler
from flowengine.sampling_params import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
V = 50


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, **kw)


@pytest.mark.parametrize("device", DEVICES)
def test_logit_bias_adds_to_the_logits_before_greedy_choice(device: str) -> None:
    logits = torch.randn(3, V, device=device)
    before = logits.clone()
    low = int(logits[0].argmin())
    # Row 0: +100 on the least likely token makes it the argmax. Row 1: -100 on the
    # argmax moves the choice to the runner-up. Row 2: no bias.
    top1 = int(logits[1].argmax())
    runner_up = int(logits[1].topk(2).indices[1])
    states = [
        SamplingState(_greedy(logit_bias={low: 100.0}), [1], []),
        # (the zero bias on another token than top1: {top1: -100, top1: 0} is {top1: 0})
        SamplingState(_greedy(logit_bias={top1: -100.0, (top1 + 1) % V: 0.0}), [1], []),
        SamplingState(_greedy(), [1], []),
    ]
    out = Sampler()(logits, states)
    assert out.sampled_token_ids.tolist() == [low, runner_up, int(logits[2].argmax())]
    assert torch.equal(logits, before)  # never modified


def test_small_logit_bias_changes_a_close_call_exactly() -> None:
    logits = torch.zeros(1, V)
    logits[0, 3] = 1.0
    logits[0, 9] = 0.75
    params = _greedy(logit_bias={9: 0.5})  # 0.75 + 0.5 > 1.0
    assert Sampler()(logits, [SamplingState(params, [1], [])]).sampled_token_ids.tolist() == [9]
    params = _greedy(logit_bias={9: 0.2})  # 0.95 < 1.0
    assert Sampler()(logits, [SamplingState(params, [1], [])]).sampled_token_ids.tolist() == [3]


@pytest.mark.parametrize("device", DEVICES)
def test_allowed_token_ids_limit_greedy_and_random_rows(device: str) -> None:
    logits = torch.randn(4, V, device=device)
    allowed = [4, 17, 33]
    expected = allowed[int(logits[0, allowed].argmax())]
    states = [
        SamplingState(_greedy(allowed_token_ids=allowed), [1], []),
        SamplingState(SamplingParams(temperature=1.5, allowed_token_ids=[8]), [1], []),
        SamplingState(SamplingParams(temperature=1.0, seed=3, allowed_token_ids=allowed), [1], []),
        SamplingState(_greedy(), [1], []),
    ]
    for _ in range(20):
        ids = Sampler()(logits, states).sampled_token_ids.tolist()
        assert ids[0] == expected
        assert ids[1] == 8
        assert ids[2] in allowed
        assert ids[3] == int(logits[3].argmax())


def test_single_token_bad_word_is_never_sampled() -> None:
    logits = torch.randn(2, V)
    top = int(logits[0].argmax())
    runner_up = int(logits[0].topk(2).indices[1])
    params = _greedy(bad_words=["x"], bad_words_token_ids=[[top]])
    out = Sampler()(logits, [SamplingState(params, [1], []), SamplingState(_greedy(), [1], [])])
    assert out.sampled_token_ids.tolist() == [runner_up, int(logits[1].argmax())]


def test_multi_token_bad_word_bans_its_last_token_only_after_its_prefix() -> None:
    logits = torch.randn(1, V)
    top = int(logits[0].argmax())
    runner_up = int(logits[0].topk(2).indices[1])
    params = _greedy(bad_words=["ab"], bad_words_token_ids=[[5, 6, top]])
    sampler = Sampler()

    def pick(outputs: list[int], prompt: list[int] | None = None) -> int:
        state = SamplingState(params, prompt or [1], outputs)
        return sampler(logits, [state]).sampled_token_ids.item()

    assert pick([9, 5, 6]) == runner_up  # generated tokens end with the prefix
    assert pick([5, 6, 9]) == top  # prefix not at the end
    assert pick([6]) == top  # only part of the prefix
    assert pick([], prompt=[5, 6]) == top  # the prompt does not count (vLLM's rule)


def test_bans_bias_and_allowed_compose_in_one_batch() -> None:
    logits = torch.randn(1, V)
    allowed = [2, 3, 4]
    order = sorted(allowed, key=lambda t: -float(logits[0, t]))
    params = _greedy(allowed_token_ids=allowed, bad_words=["w"], bad_words_token_ids=[[order[0]]],
                     logit_bias={10: 100.0})  # 10 stays banned: not allowed
    assert Sampler()(logits, [SamplingState(params, [1], [])]).sampled_token_ids.item() == order[1]


def test_logprobs_minus_one_returns_the_whole_vocabulary_of_the_raw_logits() -> None:
    logits = torch.randn(2, V, dtype=torch.float32)
    states = [
        SamplingState(_greedy(logprobs=-1, logit_bias={0: 100.0}), [1], []),
        SamplingState(_greedy(logprobs=2), [1], []),
    ]
    metadata = SamplingMetadata.from_states(states, V, "cpu")
    assert metadata.num_logprobs == [V, 2]
    ids, lps = Sampler().sample(logits, metadata).tolists()
    assert ids[0] == 0  # the bias applies to sampling ...
    ref = torch.log_softmax(logits.double(), dim=-1)
    lp = lps[0]
    assert len(lp.top_token_ids) == V and sorted(lp.top_token_ids) == list(range(V))
    # ... but the logprobs are those of the raw logits (vLLM's default raw_logprobs).
    for tok, value in zip(lp.top_token_ids, lp.top_logprobs, strict=True):
        assert value == pytest.approx(float(ref[0, tok]), abs=1e-5)
    assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)
    assert len(lps[1].top_token_ids) == 2


def test_no_edits_flag_keeps_the_fast_path() -> None:
    m = SamplingMetadata.from_states([SamplingState(_greedy(), [1], [])], V, "cpu")
    assert m.no_logits_edits and m.logit_bias_rows is None and m.allowed_rows is None
    m = SamplingMetadata.from_states([SamplingState(_greedy(logit_bias={3: 1.0}), [1], [])],
                                     V, "cpu")
    assert not m.no_logits_edits
    assert m.logit_bias_token_ids.tolist() == [3] and m.logit_bias_values.tolist() == [1.0]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"logit_bias": {3: 100.5}}, r"logit_bias\[3\] must be in \[-100, 100\]"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias must be keyed by token ids"),
        ({"logit_bias": {3: float("nan")}}, "a finite number"),
        ({"allowed_token_ids": []}, "non-empty list"),
        ({"allowed_token_ids": [-2]}, "allowed_token_ids must be token ids"),
        ({"bad_words": [" "]}, "non-blank strings"),
        ({"logprobs": -2}, "or -1 for the whole vocabulary"),
        ({"prompt_logprobs": -3}, "or -1 for the whole vocabulary"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be >= 1, or -1"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens must be >= 1, or -1"),
        ({"extra_args": {1: 2}}, "a dict with string keys"),
        ({"detokenize": False, "stop": ["x"]}, "stop strings need detokenize=True"),
        ({"detokenize": 0}, "detokenize must be true or false"),
    ],
)
def test_bad_values_are_refused_with_the_field_named(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)
