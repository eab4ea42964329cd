"""The n-gram proposer: exact drafts, longest n first, most recent match, caps."""

from __future__ import annotations

import random

import pytest

from flowengine.spec_decode import NgramProposer


def brute_force(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    for n in range(hi, lo - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_exact_drafts() -> None:
    p = NgramProposer(3, 1, 3)
    assert p.propose([1, 2, 3, 4, 1, 2]) == [3, 4, 1]
    # The longest n wins over a more recent shorter match: [2, 3] occurs at 1..2.
    assert p.propose([1, 2, 3, 9, 5, 3, 7, 2, 3]) == [9, 5, 3]
    # Most recent occurrence among equals: [5] after the second "1 2".
    assert p.propose([1, 2, 4, 1, 2, 5, 1, 2]) == [5, 1, 2]
    assert p.propose([1, 2, 3]) == []  # no repeat
    assert p.propose([7]) == []
    assert p.propose([1, 2, 3, 4, 1, 2], max_num_tokens=1) == [3]
    assert p.propose([1, 2, 3, 4, 1, 2], max_num_tokens=0) == []
    # The match right before the suffix: only the tokens that exist follow it.
    assert NgramProposer(4, 2, 2).propose([5, 5, 5, 5]) == [5]


def test_min_n_is_honoured() -> None:
    p = NgramProposer(2, 2, 3)
    assert p.propose([1, 9, 8, 7, 1]) == []  # only a 1-gram matches
    assert p.propose([1, 9, 8, 7, 1, 9]) == [8, 7]


@pytest.mark.parametrize("seed", range(20))
def test_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    k, lo = rng.randint(1, 6), rng.randint(1, 3)
    hi = lo + rng.randint(0, 3)
    p = NgramProposer(k, lo, hi)
    for _ in range(50):
        tokens = [rng.randrange(4) for _ in range(rng.randint(1, 60))]
        assert p.propose(tokens) == brute_force(tokens, k, lo, hi), tokens


def test_bad_arguments() -> None:
    for args in ((0, 1, 1), (2, 0, 1), (2, 3, 2)):
        with pytest.raises(ValueError, match="n-gram proposer"):
            NgramProposer(*args)
