"""ClientRouter: request ownership by API server process, and the split of outputs."""

from __future__ import annotations

import pytest

from flowengine.engine.client_router import ClientRouter
from flowengine.messages import AbortRequest, ClientStart, NewRequest, RequestDelta, Shutdown
from flowengine.sampling_params import SamplingParams


def _new(rid: str) -> NewRequest:
    return NewRequest(rid, [1, 2, 3], SamplingParams(max_tokens=4), 0.0)


def _delta(rid: str, finish: str | None = None) -> RequestDelta:
    return RequestDelta(rid, [7], finish_reason=finish)


def test_outputs_go_to_the_client_that_sent_the_request_until_it_finishes():
    live: set[str] = set()
    router = ClientRouter(3, live.__contains__)
    for client, rid in ((0, "a"), (1, "b"), (2, "c"), (1, "d")):
        msg, refusal = router.admit(client, _new(rid))
        assert msg is not None and msg.request_id == rid and refusal is None
        live.add(rid)
    parts = router.split([_delta("a"), _delta("b"), _delta("c"), _delta("d", "stop"),
                          _delta("b", "length")])
    assert [[d.req_id for d in part] for part in parts] == [["a"], ["b", "d", "b"], ["c"]]
    assert [d.finish_reason for d in parts[1]] == [None, "stop", "length"]
    assert len(router) == 2 and router.owner("b") is None and router.owner("c") == 2
    # An id whose request finished may be used again, by any client.
    live -= {"b", "d"}
    msg, refusal = router.admit(2, _new("b"))
    assert msg is not None and refusal is None and router.owner("b") == 2


def test_a_live_id_of_another_client_is_refused_to_the_sender_only():
    live = {"x"}
    router = ClientRouter(2, live.__contains__)
    assert router.admit(0, _new("x"))[0] is not None
    msg, refusal = router.admit(1, _new("x"))
    assert msg is None
    assert refusal is not None and refusal.req_id == "x" and refusal.finish_reason == "error"
    assert "another API server" in refusal.error
    assert router.owner("x") == 0  # the first owner keeps its request
    # The same client sending its live id again (a resubmission after an engine
    # restart) passes: the engine core keeps one copy.
    assert router.admit(0, _new("x"))[0] is not None and router.owner("x") == 0
    # A stale entry (the engine no longer holds it) does not block a new owner.
    live.clear()
    assert router.admit(1, _new("x"))[0] is not None and router.owner("x") == 1


def test_aborts_reach_only_the_senders_own_requests():
    router = ClientRouter(2, lambda rid: True)
    router.admit(0, _new("a"))
    router.admit(1, _new("b"))
    msg, _ = router.admit(1, AbortRequest(["a", "b", "zz"]))
    assert msg == AbortRequest(["b"])
    assert router.admit(1, AbortRequest(["a"])) == (None, None)
    # The entry stays until the engine's "abort" delta, which must reach client 1.
    assert router.owner("b") == 1
    assert [len(p) for p in router.split([_delta("b", "abort")])] == [0, 1]


def test_a_restarted_client_aborts_what_its_predecessor_left():
    router = ClientRouter(3, lambda rid: True)
    for client, rid in ((1, "p"), (2, "q"), (1, "r")):
        router.admit(client, _new(rid))
    msg, refusal = router.admit(1, ClientStart())
    assert msg == AbortRequest(["p", "r"]) and refusal is None
    assert router.admit(2, ClientStart())[0] == AbortRequest(["q"])
    assert router.admit(0, ClientStart()) == (None, None)


def test_shutdown_only_from_client_zero_and_indices_are_checked():
    router = ClientRouter(2, lambda rid: False)
    assert isinstance(router.admit(0, Shutdown())[0], Shutdown)
    with pytest.raises(ValueError, match="only 0"):
        router.admit(1, Shutdown())
    with pytest.raises(ValueError, match="out of range"):
        router.admit(2, _new("a"))
    with pytest.raises(ValueError, match=">= 1"):
        ClientRouter(0, lambda rid: False)
    # A delta nobody owns (an abort crossing its request's end) goes to client 0.
    assert [len(p) for p in router.split([_delta("ghost")])] == [1, 0]
