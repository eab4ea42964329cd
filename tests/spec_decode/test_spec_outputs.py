"""Several tokens in one delta (speculative decoding): a stop string that ends inside
the run drops the tokens after it, as when the tokens come one per step."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

from test_output_processor import ids, prompt, tok  # noqa: E402, F401  (fixture)

from flowengine.engine.output_processor import OutputProcessor  # noqa: E402
from flowengine.messages import RequestDelta, TokenLogprobs  # noqa: E402
from flowengine.sampling_params import SamplingParams  # noqa: E402


def _lp(t: int) -> TokenLogprobs:
    return TokenLogprobs([t], [-0.5], -0.5, 1)


def test_stop_string_inside_a_run(tok) -> None:  # noqa: F811
    for stream in (True, False):
        op = OutputProcessor(tok, stream=stream)
        op.add_request(prompt("a", SamplingParams(max_tokens=16, stop=["END"], logprobs=1)))
        run = ids("xyENDzz")
        (out,), stop = op.process([RequestDelta("a", run, [_lp(t) for t in run])])
        c = out.outputs[0]
        assert (c.text, c.token_ids, c.finish_reason, c.stop_reason) == (
            "xy", ids("xyEND"), "stop", "END")
        assert len(c.logprobs) == 5 and stop == ["a"] and out.finished


def test_run_without_a_match_and_a_finished_run(tok) -> None:  # noqa: F811
    op = OutputProcessor(tok, stream=False)
    op.add_request(prompt("a", SamplingParams(max_tokens=16, stop=["END"])))
    (out,), _ = op.process([RequestDelta("a", ids("abE"))])
    assert not out.finished and out.outputs[0].text == "ab"  # "E" held back
    (out,), stop = op.process([RequestDelta("a", ids("Nd"), finish_reason="length")])
    c = out.outputs[0]
    assert (c.text, c.token_ids, c.finish_reason) == ("abENd", ids("abENd"), "length")
    # A match inside a run the engine had finished anyway: nothing to stop.
    op.add_request(prompt("b", SamplingParams(max_tokens=16, stop=["EN"])))
    (out,), stop = op.process([RequestDelta("b", ids("qENr"), finish_reason="length")])
    c = out.outputs[0]
    assert (c.text, c.token_ids, c.finish_reason, c.stop_reason, stop) == (
        "q", ids("qEN"), "stop", "EN", [])
