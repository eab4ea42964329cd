"""The pure beam-search bookkeeping (flowengine/beam_search.py) on hand-made
log-probability tables, worked out by hand with transformers' rules."""

from __future__ import annotations

import pytest

from flowengine.beam_search import (
    BeamSearch,
    BeamSearchParams,
    check_request,
    length_normalized,
    num_candidates,
    step_params,
)

EOS = 3
# Next-token log-probabilities after each generated prefix (a toy model).
TABLE = {
    (): {0: -0.1, 1: -0.5, EOS: -1.0, 2: -3.0},
    (0,): {EOS: -0.2, 0: -1.0, 1: -2.0, 2: -4.0},
    (1,): {0: -0.3, EOS: -0.4, 1: -3.0, 2: -5.0},
    (1, 0): {2: -0.1, 0: -2.0, 1: -3.0, EOS: -4.0},
    (0, 0): {1: -0.05, 0: -2.0, 2: -3.0, EOS: -4.0},
}
PROMPT = [7, 8]


def run(search: BeamSearch) -> int:
    steps = 0
    while not search.done:
        inputs = search.beam_inputs()
        assert all(ids[: len(PROMPT)] == PROMPT for ids in inputs)
        search.advance([TABLE[tuple(ids[len(PROMPT):])] for ids in inputs])
        steps += 1
    return steps


@pytest.mark.parametrize("early_stopping", [True, False, "never"])
def test_hand_worked_search(early_stopping):
    # Step 1: beams [0] (-0.1), [1] (-0.5); the EOS ranks 3rd, outside the top W=2.
    # Step 2: [0,EOS] (-0.3) ranks 1st and finishes, score -0.3/2; live: [1,0] (-0.8),
    #         [0,0] (-1.1) ([1,EOS], 3rd, is a spare and not kept).
    # Step 3 (max_tokens): [1,0,2] -0.9 and [0,0,1] -1.15 end; scores /3.
    params = BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=1.0,
                              early_stopping=early_stopping)
    search = BeamSearch(PROMPT, params, [EOS])
    assert run(search) == 3
    out = search.output(decode=lambda ids: ",".join(map(str, ids)))
    got = [(s.output_token_ids, s.cum_logprob, s.score, s.finish_reason, s.text)
           for s in out.sequences]
    assert got == [
        ([0, EOS], pytest.approx(-0.3), pytest.approx(-0.15), "stop", "0"),
        ([1, 0, 2], pytest.approx(-0.9), pytest.approx(-0.3), "length", "1,0,2"),
    ]
    assert out.sequences[0].tokens == PROMPT + [0, EOS]
    assert [sorted(d) for d in out.sequences[1].logprobs] == [[0, 1, 2, EOS]] * 3
    assert out.sequences[1].logprobs[1][0].logprob == -0.3  # step 2 of beam [1]
    assert out.sequences[1].logprobs[1][0].rank == 1


def test_length_penalty_changes_the_order():
    # length_penalty 0: raw cum_logprob; [0,EOS] -0.3 beats [1,0,2] -0.9 still, and
    # the second place goes to [1,0,2] over [0,0,1] (-1.15).
    params = BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=0.0)
    search = BeamSearch(PROMPT, params, [EOS])
    run(search)
    scores = [(s.output_token_ids, s.score) for s in search.output().sequences]
    assert scores == [([0, EOS], pytest.approx(-0.3)), ([1, 0, 2], pytest.approx(-0.9))]
    # A strongly negative penalty favours the short hypothesis even more: -0.3*2^2.
    params = BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=-2.0)
    search = BeamSearch(PROMPT, params, [EOS])
    run(search)
    scores = [(s.output_token_ids, s.score) for s in search.output().sequences]
    assert scores == [([0, EOS], pytest.approx(-1.2)), ([1, 0, 2], pytest.approx(-8.1))]


def test_early_stopping_true_stops_when_width_hypotheses_finished():
    table = {
        (): {0: -0.1, 1: -0.2, 2: -5.0, EOS: -6.0},
        (0,): {EOS: -0.1, 0: -3.0, 1: -4.0, 2: -5.0},
        (1,): {EOS: -0.1, 0: -3.0, 1: -4.0, 2: -5.0},
    }
    params = BeamSearchParams(beam_width=2, max_tokens=10, early_stopping=True)
    search = BeamSearch(PROMPT, params, [EOS])
    search.advance([table[()]])
    search.advance([table[(0,)], table[(1,)]])
    # Both top-ranked continuations end: two hypotheses, the search is done.
    assert search.done and search.beam_inputs() == []
    assert [s.output_token_ids for s in search.output().sequences] == [[0, EOS], [1, EOS]]


def test_early_stopping_false_heuristic_and_never():
    # After step 2 the kept hypotheses score -0.2/2=-0.1 and -0.3/2=-0.15; the best
    # live beam has cum -3.1 after 2 tokens: -3.1/2 < -0.15, no improvement: done.
    # With "never" and length_penalty 1 it is scored at max_tokens=100: -0.031 > -0.15,
    # so the search goes on.
    table = {
        (): {0: -0.1, 1: -0.2, 2: -5.0, EOS: -6.0},
        (0,): {EOS: -0.1, 0: -3.0, 1: -4.0, 2: -5.0},
        (1,): {EOS: -0.1, 0: -3.0, 1: -4.0, 2: -5.0},
    }
    for early, done in ((False, True), ("never", False)):
        params = BeamSearchParams(beam_width=2, max_tokens=100, early_stopping=early)
        search = BeamSearch(PROMPT, params, [EOS])
        search.advance([table[()]])
        search.advance([table[(0,)], table[(1,)]])
        assert search.done is done, early
        assert [s.score for s in search.output().sequences] == [
            pytest.approx(-0.1), pytest.approx(-0.15)]


def test_ignore_eos_runs_to_max_tokens():
    params = BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True)
    search = BeamSearch(PROMPT, params, [EOS])
    assert search.eos_token_ids == frozenset()
    search.advance([TABLE[()]])
    assert [b.tokens for b in search.running] == [[0], [1]]
    search.advance([TABLE[(0,)], TABLE[(1,)]])
    # EOS is an ordinary token now: [0,EOS] (-0.3) leads.
    assert [b.tokens for b in search.running] == [[0, EOS], [1, 0]]


def test_include_stop_str_in_output_keeps_the_eos_text():
    for include, text in ((False, "0"), (True, "0,3")):
        params = BeamSearchParams(beam_width=2, max_tokens=3,
                                  include_stop_str_in_output=include)
        search = BeamSearch(PROMPT, params, [EOS])
        run(search)
        out = search.output(decode=lambda ids: ",".join(map(str, ids)))
        assert out.sequences[0].text == text


def test_step_params_and_candidates():
    params = BeamSearchParams(beam_width=3, max_tokens=5, temperature=0.5)
    assert num_candidates(3, 1) == 6 and num_candidates(3, 2) == 9 and num_candidates(3, 0) == 6
    sp = step_params(params, 1)
    assert (sp.max_tokens, sp.logprobs, sp.temperature, sp.ignore_eos, sp.detokenize) == (
        1, 6, 0.5, True, False)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"beam_width": 0}, "beam_width must be an integer >= 1"),
        ({"beam_width": True}, "beam_width must be an integer >= 1"),
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
        ({"temperature": -1.0}, "temperature must be >= 0"),
        ({"length_penalty": float("nan")}, "length_penalty must be a finite number"),
        ({"early_stopping": "sometimes"}, 'early_stopping must be true, false or "never"'),
        ({"early_stopping": 1}, 'early_stopping must be true, false or "never"'),
        ({"ignore_eos": 1}, "ignore_eos must be true or false"),
    ],
)
def test_params_validation(kwargs, message):
    fields = {"beam_width": 2, "max_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=message):
        BeamSearchParams(**fields)


def test_check_request_limits():
    params = BeamSearchParams(beam_width=11, max_tokens=10)
    with pytest.raises(ValueError, match="beam_width=11 needs the top 22 log-probabilities"):
        check_request(params, 5, 100, 20, 1)
    check_request(params, 5, 100, -1, 1)  # no limit
    with pytest.raises(ValueError, match="exceeds max_model_len=14"):
        check_request(BeamSearchParams(beam_width=2, max_tokens=10), 5, 14, 20, 1)


def test_advance_checks_the_number_of_beams():
    search = BeamSearch(PROMPT, BeamSearchParams(beam_width=2, max_tokens=3), [EOS])
    with pytest.raises(ValueError, match="got log-probabilities for 2 beams, 1 are live"):
        search.advance([TABLE[()], TABLE[()]])


def test_extreme_length_penalties_score_their_limit():
    assert length_normalized(-3.0, 3, 1.0) == -1.0
    assert length_normalized(-3.0, 1, 1e308) == -3.0  # 1 ** anything is 1
    assert length_normalized(-3.0, 2, 1e308) == 0.0  # 2 ** 1e308 overflows: -> -0.0
    assert length_normalized(-3.0, 2, -1e308) == float("-inf")  # 2 ** -1e308 == 0.0
    for lp in (1e308, -1e308):
        params = BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=lp)
        search = BeamSearch(PROMPT, params, [EOS])
        run(search)  # no OverflowError / ZeroDivisionError
        assert len(search.output().sequences) == 2
