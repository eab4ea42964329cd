"""StopStringChecker: character-level matching, hold-back, truncation, flush."""

from __future__ import annotations

import random

import pytest

from flowengine.tokenize.stop_checker import StopStringChecker


def feed(checker: StopStringChecker, deltas: list[str]) -> tuple[list[str], str | None]:
    """Feed deltas; returns (emitted pieces incl. the final flush, matched stop)."""
    emitted, matched = [], None
    for delta in deltas:
        text, m = checker.process(delta)
        emitted.append(text)
        if m is not None:
            matched = m
    if matched is None:
        emitted.append(checker.flush())
    return emitted, matched


def reference(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """The output for the whole text at once: cut at the earliest-completing match."""
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or (i + len(s), i) < (best[0], best[1])):
            best = (i + len(s), i, s)
    if best is None:
        return text, None
    end, start, s = best
    return text[: end if include else start], s


def test_match_across_deltas_and_hold_back() -> None:
    checker = StopStringChecker(["STOP"])
    assert checker.process("Hello S") == ("Hello ", None)
    assert checker.process("T") == ("", None)
    assert checker.process("OP and more") == ("", "STOP")
    assert checker.process(" later") == ("", None)
    assert checker.is_stopped and checker.matched == "STOP"


def test_match_inside_one_delta_include_stop_string() -> None:
    checker = StopStringChecker(["\n\n"], include_stop_str_in_output=True)
    assert checker.process("line one\n\nline two") == ("line one\n\n", "\n\n")


def test_false_start_is_released() -> None:
    checker = StopStringChecker(["</answer>"])
    assert checker.process("a </ans") == ("a ", None)
    assert checker.process("wer is b") == ("</answer is b", None)


def test_held_back_text_released_on_flush() -> None:
    checker = StopStringChecker(["STOP"])
    assert checker.process("the end ST") == ("the end ", None)
    assert checker.flush() == "ST"
    assert checker.flush() == ""


def test_earliest_completing_match_wins() -> None:
    # "bc" completes at character 3, "abcd" at 4: a char-by-char stream sees "bc" first.
    assert feed(StopStringChecker(["abcd", "bc"]), ["xabcd"]) == (["xa"], "bc")
    # Same end: the one starting earliest (longest) wins, so none of it is shown.
    assert feed(StopStringChecker(["c", "bc"]), ["abc"]) == (["a"], "bc")
    assert feed(StopStringChecker(["c", "bc"], True), ["abc"]) == (["abc"], "bc")


def test_no_stop_strings_passes_text_through() -> None:
    checker = StopStringChecker([])
    assert checker.process("anything") == ("anything", None)
    assert checker.flush() == ""


def test_empty_stop_string_is_rejected() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        StopStringChecker(["ok", ""])


@pytest.mark.parametrize("include", [False, True])
def test_fuzz_any_split_matches_whole_text_reference(include: bool) -> None:
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    alphabet = "ab\n世🙂"
    for case in range(500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = [
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
            for _ in range(rng.randint(1, 3))
        ]
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        deltas = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        emitted, matched = feed(StopStringChecker(stops, include), deltas)
        where = f"seed={seed} case={case} text={text!r} stops={stops} deltas={deltas}"
        # Emission is append-only, so equal totals mean nothing past the stop ever left.
        assert ("".join(emitted), matched) == reference(text, stops, include), where


def test_fuzz_hold_back_is_the_longest_stop_prefix_suffix() -> None:
    """Exactly the longest suffix that starts a stop string is held back, no more."""
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    for case in range(500):
        stops = ["".join(rng.choices("abc", k=rng.randint(1, 5))) for _ in range(rng.randint(1, 3))]
        checker = StopStringChecker(stops)
        text = "".join(rng.choices("abcd", k=rng.randint(0, 12)))
        emitted, matched = checker.process(text)
        if matched is not None:
            continue
        expected_hold = max(
            (k for k in range(1, len(text) + 1) if any(s.startswith(text[-k:]) for s in stops)),
            default=0,
        )
        assert emitted == text[: len(text) - expected_hold], (seed, case, stops, text)
