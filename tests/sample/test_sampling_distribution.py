"""Temperature, top-k, top-p and min-p checked statistically on a known distribution.

20 000 rows of the same 10-token distribution are sampled in one batch. Tokens outside
the allowed set must never appear; each allowed token's count must lie within 5
binomial standard deviations of n times its renormalised probability (a false alarm
has probability below 1e-5 per test).
"""

from __future__ import annotations

import math

import pytest
import torch

import flowengine.sample.sampler as sampler_module
from flowengine.sample.metadata import SamplingState
from flowengine.sample.sampler import Sampler
from flowengine.sampling_params import SamplingParams

NUM_DRAWS = 20_000
# Sorted for readability; the tests place them at a random permutation of the ids.
PROBS = [0.3, 0.2, 0.15, 0.1, 0.08, 0.07, 0.05, 0.03, 0.015, 0.005]


def draw(params: SamplingParams, perm: torch.Tensor, seeded: bool = False) -> torch.Tensor:
    """Counts per token id of NUM_DRAWS samples; PROBS[j] belongs to token perm[j]."""
    logits = torch.empty(len(PROBS))
    logits[perm] = torch.tensor(PROBS).log()
    states = [
        SamplingState(params.clone(seed=i) if seeded else params, [0], []) for i in range(NUM_DRAWS)
    ]
    tokens = Sampler()(logits.expand(NUM_DRAWS, -1).contiguous(), states).sampled_token_ids
    return torch.bincount(tokens, minlength=len(PROBS))


def check(counts: torch.Tensor, perm: torch.Tensor, weights: list[float]) -> None:
    """weights[j] (unnormalised, 0 = forbidden) is the expected weight of token perm[j]."""
    total = sum(weights)
    for j, w in enumerate(weights):
        count = int(counts[perm[j]])
        if w == 0:
            assert count == 0, f"token with p={PROBS[j]} is outside the allowed set"
            continue
        q = w / total
        sigma = math.sqrt(NUM_DRAWS * q * (1 - q))
        assert abs(count - NUM_DRAWS * q) <= 5 * sigma, (j, count, NUM_DRAWS * q, sigma)


@pytest.fixture(autouse=True, params=["kernels", "torch-ops"])
def sampling_path(request, monkeypatch) -> None:
    """Every test on both CPU paths: the C sampler (the default) and the torch ops."""
    monkeypatch.setattr(sampler_module, "FUSED_SAMPLING", request.param == "kernels")


@pytest.fixture
def perm() -> torch.Tensor:
    return torch.randperm(len(PROBS))


def keep_first(k: int) -> list[float]:
    return [p if j < k else 0.0 for j, p in enumerate(PROBS)]


def test_plain_sampling_follows_the_softmax(perm) -> None:
    check(draw(SamplingParams(temperature=1.0), perm), perm, PROBS)


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature(perm, temperature: float) -> None:
    # softmax(log p / T) is proportional to p ** (1 / T).
    expected = [p ** (1 / temperature) for p in PROBS]
    check(draw(SamplingParams(temperature=temperature), perm), perm, expected)


def test_top_k(perm) -> None:
    check(draw(SamplingParams(top_k=3), perm), perm, keep_first(3))


def test_top_p(perm) -> None:
    # Smallest set reaching 0.7: 0.3 + 0.2 + 0.15 + 0.1 = 0.75.
    check(draw(SamplingParams(top_p=0.7), perm), perm, keep_first(4))


def test_min_p(perm) -> None:
    # Threshold 0.25 * 0.3 = 0.075: keeps 0.3, 0.2, 0.15, 0.1, 0.08.
    check(draw(SamplingParams(min_p=0.25), perm), perm, keep_first(5))


def test_top_k_then_top_p(perm) -> None:
    # top-k 5 leaves mass 0.83; renormalised, the nucleus of 0.5 is {0.3, 0.2} (0.60).
    check(draw(SamplingParams(top_k=5, top_p=0.5), perm), perm, keep_first(2))


def test_seeded_rows_follow_the_same_distribution(perm) -> None:
    params = SamplingParams(temperature=1.0, top_k=6)
    check(draw(params, perm, seeded=True), perm, keep_first(6))
