"""Speculation on the default model: the very tokens of no speculation.

An engine without `speculative_config`, one with n-gram speculation and one with the
model as its own draft model, the same requests in one batch each: greedy (the issue's CI acceptance), greedy with logprobs, penalties, min_tokens +
stop_token_ids, a max_tokens cut, and seeded random sampling (each verification row
draws with its own position's seed, so even sampled tokens are identical). Drafts must
actually be accepted (acceptance counters), and every KV block is free at the end.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from flowengine import LLM, SamplingParams

pytestmark = pytest.mark.slow

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
        "prompt_lookup_max": 4}
# A workload that quotes its input: the model is asked to repeat a piece of code.
SOURCE = (Path(__file__).resolve().parents[2] / "flowengine" / "core" / "stop_checker.py"
          ).read_text()[:600]
PROMPTS = [
    f"Copy this Python code exactly.\n\n{SOURCE}\n\nCopy:\n{SOURCE[:80]}",
    "Count: one, two, three, four, five, six, seven, eight, nine, ten, one, two, three,",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):",
]
MAX_TOKENS = 24


def _params() -> list[SamplingParams]:
    greedy = dict(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [
        SamplingParams(**greedy),
        SamplingParams(**greedy, logprobs=3),
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, repetition_penalty=1.3,
                       frequency_penalty=0.2),
        SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=MAX_TOKENS,
                       min_tokens=4, stop_token_ids=[13]),
        SamplingParams(**{**greedy, "max_tokens": 7}),
        SamplingParams(**greedy),
        # A stop string inside an accepted run: no token after it is delivered.
        SamplingParams(**greedy, stop=[" six"]),
    ]


def _run(llm: LLM) -> list[tuple]:
    prompts = PROMPTS + [PROMPTS[0], PROMPTS[1], PROMPTS[1]]
    outs = llm.generate(prompts, _params(), use_tqdm=False)
    result = []
    for o in outs:
        c = o.outputs[0]
        lps = None if c.logprobs is None else [
            {t: round(lp.logprob, 4) for t, lp in d.items()} for d in c.logprobs]
        result.append((c.token_ids, c.finish_reason, c.stop_reason, c.text, lps))
    return result


@pytest.fixture(scope="module")
def reference(default_model_path):
    base = LLM(default_model_path)
    return _run(base)


@pytest.fixture(scope="module", params=["ngram", "draft_model"])
def runs(request, default_model_path, reference):
    config = SPEC if request.param == "ngram" else {"model": default_model_path,
                                                    "num_speculative_tokens": 3}
    spec = LLM(default_model_path, speculative_config=config)
    got = _run(spec)
    return reference, got, spec


def test_outputs_equal_no_speculation(runs) -> None:
    reference, got, _ = runs
    assert len(got) == 7
    for i, (ref, out) in enumerate(zip(reference, got, strict=True)):
        assert out[:4] == ref[:4], i
        if ref[4] is not None:  # logprobs: same tokens, values to float32 noise
            assert [set(d) for d in out[4]] == [set(d) for d in ref[4]], i
            for d_out, d_ref in zip(out[4], ref[4], strict=True):
                for t in d_ref:
                    assert d_out[t] == pytest.approx(d_ref[t], abs=2e-3), i
    assert len(got[4][0]) == 7 and got[4][1] == "length"
    assert got[6][1:3] == ("stop", " six") and len(got[6][0]) < MAX_TOKENS


def test_drafts_were_accepted_and_blocks_freed(runs) -> None:
    _, _, spec = runs
    stats = spec.engine.scheduler.make_stats()
    assert stats.spec_decode_num_drafts_total > 0
    assert 0 < stats.spec_decode_num_accepted_tokens_total <= \
        stats.spec_decode_num_draft_tokens_total
    assert sum(stats.spec_decode_num_accepted_tokens_per_pos) == \
        stats.spec_decode_num_accepted_tokens_total
    assert stats.num_free_blocks == stats.num_total_blocks


def test_async_scheduling_in_engine_processes_equals_no_speculation(default_model_path,
                                                                    reference) -> None:
    """n-gram drafts with two steps in flight in the engine processes (the server's
    default on CUDA): the same tokens, finish and stop reasons and texts."""
    spec = LLM(default_model_path, speculative_config=SPEC, placement="multiproc",
               async_scheduling=True)
    try:
        got = _run(spec)
    finally:
        spec.shutdown()
    assert [out[:4] for out in got] == [ref[:4] for ref in reference]
