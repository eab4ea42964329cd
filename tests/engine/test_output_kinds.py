"""RequestOutputKind: one OutputProcessor gives each request the outputs its
`SamplingParams.output_kind` asks for (CUMULATIVE, DELTA, FINAL_ONLY), exactly, for
n=1 and n=2, with a held-back stop string and logprobs; `RequestOutput.add` folds."""

from __future__ import annotations

import msgspec
import pytest
from test_output_processor import ids, prompt, tok  # noqa: F401 - the byte tokenizer fixture

from flowengine.engine.output_processor import OutputProcessor
from flowengine.messages import NewRequest, RequestDelta, TokenLogprobs
from flowengine.outputs import CompletionOutput, RequestOutput
from flowengine.sampling_params import RequestOutputKind, SamplingParams

K = RequestOutputKind


def lp(value: float) -> TokenLogprobs:
    return TokenLogprobs(top_token_ids=[], top_logprobs=[], sampled_logprob=value,
                         sampled_rank=1)


# Per engine step: the deltas of samples 0 and 1 of request "r" (n=2, stop "END",
# logprobs=0). Sample 0 holds "E" back (it may start "END"), then a stop string ends it;
# sample 1 runs to max_tokens (length).
STEPS = [
    [RequestDelta("r-0", ids("aE"), [lp(-1.0), lp(-2.0)]), RequestDelta("r-1", ids("x"), [lp(-0.5)])],
    [RequestDelta("r-1", ids("y"), [lp(-0.25)])],
    [RequestDelta("r-0", ids("ND"), [lp(-1.0), lp(-1.0)]),
     RequestDelta("r-1", ids("z"), [lp(-0.25)], finish_reason="length")],
]  # fmt: skip


def view(out: RequestOutput) -> tuple:
    """(finished, [(index, text, token ids, sampled logprobs, cumulative, finish, stop)])."""
    return out.finished, [
        (c.index, c.text, c.token_ids,
         None if c.logprobs is None else [e[t].logprob for e, t in zip(c.logprobs, c.token_ids,
                                                                      strict=True)],
         c.cumulative_logprob, c.finish_reason, c.stop_reason)
        for c in out.outputs
    ]  # fmt: skip


FINAL_0 = (0, "a", ids("aEND"), [-1.0, -2.0, -1.0, -1.0], -5.0, "stop", "END")
FINAL_1 = (1, "xyz", ids("xyz"), [-0.5, -0.25, -0.25], -1.0, "length", None)
EXPECTED = {
    K.DELTA: [
        (False, [(0, "a", ids("aE"), [-1.0, -2.0], -3.0, None, None),
                 (1, "x", ids("x"), [-0.5], -0.5, None, None)]),
        (False, [(1, "y", ids("y"), [-0.25], -0.75, None, None)]),
        (True, [(0, "", ids("ND"), [-1.0, -1.0], -5.0, "stop", "END"),
                (1, "z", ids("z"), [-0.25], -1.0, "length", None)]),
    ],
    K.CUMULATIVE: [
        (False, [(0, "a", ids("aE"), [-1.0, -2.0], -3.0, None, None),
                 (1, "x", ids("x"), [-0.5], -0.5, None, None)]),
        (False, [(0, "a", ids("aE"), [-1.0, -2.0], -3.0, None, None),
                 (1, "xy", ids("xy"), [-0.5, -0.25], -0.75, None, None)]),
        (True, [FINAL_0, FINAL_1]),
    ],
    K.FINAL_ONLY: [(True, [FINAL_0, FINAL_1])],
}  # fmt: skip


def run(tok, kind: RequestOutputKind, rid: str = "r") -> tuple[list[tuple], list[list[str]]]:  # noqa: F811
    op = OutputProcessor(tok)  # neither stream nor final_only: each request's own kind
    params = SamplingParams(n=2, max_tokens=3, stop=["END"], logprobs=0, output_kind=kind)
    op.add_request(prompt(rid, params))
    views, stops = [], []
    for step in STEPS:
        deltas = [msgspec.structs.replace(d, req_id=d.req_id.replace("r-", f"{rid}-"))
                  for d in step]
        outs, to_stop = op.process(deltas)
        views += [view(o) for o in outs]
        stops.append(to_stop)
    assert len(op) == 0
    return views, stops


@pytest.mark.parametrize("kind", list(K))
def test_each_kind_gives_its_exact_outputs(tok, kind) -> None:  # noqa: F811
    views, stops = run(tok, kind)
    assert views == EXPECTED[kind]
    assert stops == [[], [], ["r-0"]]  # the stop string frees sample 0's blocks


def test_kinds_mix_in_one_processor_and_n1(tok) -> None:  # noqa: F811
    op = OutputProcessor(tok)
    for rid, kind in (("c", K.CUMULATIVE), ("d", K.DELTA), ("f", K.FINAL_ONLY)):
        op.add_request(prompt(rid, SamplingParams(max_tokens=4, stop=["!"], output_kind=kind)))
    seen: dict[str, list] = {"c": [], "d": [], "f": []}
    for step in (ids("h"), ids("i"), ids("?!")):
        outs, _ = op.process([RequestDelta(r, step) for r in "cdf"])
        for o in outs:
            c = o.outputs[0]
            seen[o.request_id].append((c.text, c.token_ids, c.finish_reason, o.finished))
    assert seen == {
        "c": [("h", ids("h"), None, False), ("hi", ids("hi"), None, False),
              ("hi?", ids("hi?!"), "stop", True)],
        "d": [("h", ids("h"), None, False), ("i", ids("i"), None, False),
              ("?", ids("?!"), "stop", True)],
        "f": [("hi?", ids("hi?!"), "stop", True)],
    }  # fmt: skip


def test_cumulative_outputs_are_snapshots(tok) -> None:  # noqa: F811
    op = OutputProcessor(tok)
    op.add_request(prompt("s", SamplingParams(max_tokens=4, logprobs=0)))
    (first,), _ = op.process([RequestDelta("s", ids("a"), [lp(-1.0)])])
    op.process([RequestDelta("s", ids("b"), [lp(-1.0)], finish_reason="length")])
    assert first.outputs[0].token_ids == ids("a") and len(first.outputs[0].logprobs) == 1


def test_resubmit_after_restart_in_every_kind(tok) -> None:  # noqa: F811
    """A restart recomputes after what each kind has seen: the processor's own record
    of delivered tokens, never the outputs it handed out."""
    op = OutputProcessor(tok)
    for rid, kind in (("c", K.CUMULATIVE), ("d", K.DELTA), ("f", K.FINAL_ONLY)):
        op.add_request(prompt(rid, SamplingParams(max_tokens=8, output_kind=kind)))
    op.process([RequestDelta(r, ids("ab")) for r in "cdf"])
    msgs = {m.request_id: m for m in op.resubmit_requests()}
    assert {r: m.output_token_ids for r, m in msgs.items()} == {r: ids("ab") for r in "cdf"}
    assert all(m.sampling_params.output_kind == k for m, k in
               zip(msgs.values(), (K.CUMULATIVE, K.DELTA, K.FINAL_ONLY), strict=True))


def test_output_kind_is_validated_and_crosses_processes() -> None:
    for bad in ("DELTA", 3, True, None):
        with pytest.raises(ValueError, match="output_kind must be a RequestOutputKind"):
            SamplingParams(output_kind=bad)
    assert SamplingParams().output_kind is K.CUMULATIVE  # vLLM's default
    assert SamplingParams(output_kind=1).output_kind is K.DELTA
    msg = NewRequest("x", [1], SamplingParams(output_kind=K.FINAL_ONLY), 0.0)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(msg), type=NewRequest)
    assert back.sampling_params.output_kind is K.FINAL_ONLY
    # The default is left out of the wire form (omit_defaults).
    assert b"output_kind" not in msgspec.msgpack.encode(SamplingParams())


def test_request_output_add() -> None:
    def out(*completions: CompletionOutput, finished: bool = False) -> RequestOutput:
        return RequestOutput("r", "p", [1], list(completions), finished)

    pending = out(CompletionOutput(1, "b", [2], -1.0))
    pending.add(out(CompletionOutput(0, "a", [1], -0.5), CompletionOutput(1, "c", [3], -2.0)),
                aggregate=True)
    pending.add(out(CompletionOutput(0, "!", [9], -0.75, finish_reason="length"),
                    finished=True), aggregate=True)
    assert [(c.index, c.text, c.token_ids, c.cumulative_logprob, c.finish_reason)
            for c in pending.outputs] == [(0, "a!", [1, 9], -0.75, "length"),
                                          (1, "bc", [2, 3], -2.0, None)]  # fmt: skip
    assert pending.finished
    cumulative = out(CompletionOutput(0, "a", [1]))
    newer = CompletionOutput(0, "ab", [1, 2], finish_reason="stop")
    cumulative.add(out(newer, finished=True), aggregate=False)
    assert cumulative.outputs == [newer] and cumulative.finished
