"""`flowengine bench throughput`: a run whose requests end in an error reports no figure."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from flowengine.bench.throughput import BenchError, run_flowengine


class _FakeLLM:
    """generate() answers each prompt with `tokens` ids, or finish_reason "error" for
    the prompts whose index is in `errors` (as LLM.generate does after a failed step)."""

    def __init__(self, errors: set[int]):
        self.errors, self.calls = errors, 0

    def generate(self, prompts, params, use_tqdm=False):
        self.calls += 1
        timed = self.calls == 2
        outs = []
        for i, _ in enumerate(prompts):
            bad = timed and i in self.errors
            out = SimpleNamespace(token_ids=[] if bad else [7] * params.max_tokens,
                                  finish_reason="error" if bad else "length")
            outs.append(SimpleNamespace(outputs=[out]))
        return outs


def test_counts_output_tokens_of_a_clean_run():
    res = run_flowengine(_FakeLLM(set()), [[1, 2, 3]] * 4, output_len=5)
    assert (res.num_requests, res.prompt_tokens, res.output_tokens) == (4, 12, 20)


def test_a_failed_request_fails_the_run():
    with pytest.raises(BenchError, match=r"1 of 4 requests of the timed run failed"):
        run_flowengine(_FakeLLM({2}), [[1, 2, 3]] * 4, output_len=5)
