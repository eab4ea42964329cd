"""Repetition, frequency and presence penalties against hand-computed and HF values."""

from __future__ import annotations

import torch
from transformers import RepetitionPenaltyLogitsProcessor

from flowengine.sample.metadata import SamplingMetadata, SamplingState
from flowengine.sample.penalties import apply_penalties, token_counts
from flowengine.sample.sampler import Sampler
from flowengine.sampling_params import SamplingParams


def test_token_counts_ignore_padding() -> None:
    ids = torch.tensor([[2, 2, 0, 5], [1, 5, 5, 5]])  # 5 = vocab size = padding
    assert token_counts(ids, 5).tolist() == [[1, 0, 2, 0, 0], [0, 1, 0, 0, 0]]


def test_hand_computed_example() -> None:
    # Values are exact in float32, so the comparison is exact.
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0, 0.0]])
    prompt = torch.tensor([[0, 1]])
    output = torch.tensor([[2, 2, 3]])
    apply_penalties(
        logits,
        prompt,
        output,
        repetition_penalties=torch.tensor([2.0]),
        frequency_penalties=torch.tensor([0.5]),
        presence_penalties=torch.tensor([0.25]),
    )
    # token 0: prompt, 2 > 0 -> 2 / 2 = 1
    # token 1: prompt, -1 < 0 -> -1 * 2 = -2
    # token 2: output twice: 0.5 / 2 - 0.5 * 2 - 0.25 = -1.0
    # token 3: output once: -0.5 * 2 - 0.5 * 1 - 0.25 = -1.75
    # tokens 4, 5: unseen, unchanged
    assert logits.tolist() == [[1.0, -2.0, -1.0, -1.75, 3.0, 0.0]]


def test_repetition_penalty_matches_hugging_face() -> None:
    vocab_size = 40
    penalties = [1.3, 0.7, 1.0]
    logits = torch.randn(3, vocab_size)
    prompts = [torch.randint(0, vocab_size, (7,)).tolist() for _ in penalties]
    outputs = [torch.randint(0, vocab_size, (5,)).tolist() for _ in penalties]
    expected = logits.clone()
    for row, penalty in enumerate(penalties):
        input_ids = torch.tensor([prompts[row] + outputs[row]])
        processor = RepetitionPenaltyLogitsProcessor(penalty)
        expected[row] = processor(input_ids, logits[row : row + 1].clone())[0]

    states = [
        SamplingState(SamplingParams(repetition_penalty=p), prompts[i], outputs[i], None)
        for i, p in enumerate(penalties)
    ]
    md = SamplingMetadata.from_states(states, vocab_size, "cpu")
    assert md.frequency_penalties is None and md.presence_penalties is None
    got = logits.clone()
    apply_penalties(
        got, md.prompt_token_ids, md.output_token_ids, md.repetition_penalties, None, None
    )
    assert torch.equal(got, expected)


def test_frequency_presence_count_generated_tokens_only() -> None:
    logits = torch.zeros(1, 4)
    md = SamplingMetadata.from_states(
        [
            SamplingState(
                SamplingParams(frequency_penalty=1.0, presence_penalty=0.5), [0, 0], [1, 1, 1, 2]
            )
        ],
        4,
        "cpu",
    )
    assert md.prompt_token_ids is None  # no repetition penalty: the prompt is not needed
    apply_penalties(
        logits, None, md.output_token_ids, None, md.frequency_penalties, md.presence_penalties
    )
    assert logits.tolist() == [[0.0, -3.5, -1.5, 0.0]]


def test_sampler_applies_penalties_before_greedy_argmax() -> None:
    logits = torch.tensor([[1.0, 4.0, 3.0, 0.0], [1.0, 4.0, 3.0, 0.0]])
    before = logits.clone()
    states = [
        # 4 - 1.5 * 1 = 2.5 < 3: token 2 wins.
        SamplingState(SamplingParams(temperature=0, frequency_penalty=1.5), [0], [1]),
        # No penalty in the same batch: unchanged argmax.
        SamplingState(SamplingParams(temperature=0), [0], [1]),
    ]
    out = Sampler()(logits, states)
    assert out.sampled_token_ids.tolist() == [2, 1]
    assert torch.equal(logits, before)  # the caller's logits are never modified
