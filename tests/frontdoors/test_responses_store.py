"""The Responses API's store: LRU order, both bounds, exact byte accounting."""

from __future__ import annotations

import orjson
import pytest

from flowengine.entrypoints.openai.responses_store import ResponseStore


def body(response_id: str, pad: str = "") -> dict:
    return {"id": response_id, "object": "response", "pad": pad}


def size(b: dict, messages: list[dict[str, str]], output: str) -> int:
    return (
        len(orjson.dumps(b))
        + sum(len(m["role"]) + len(m["content"]) for m in messages)
        + len(output)
    )


USER = [{"role": "user", "content": "hi"}]


def test_lru_eviction_by_count_and_touch_on_get():
    store = ResponseStore(max_entries=3, max_bytes=1 << 20)
    for rid in ("a", "b", "c"):
        assert store.put(body(rid), USER, "out")
    assert store.ids() == ["a", "b", "c"]
    assert store.get("a").body == body("a")  # now the most recently used
    assert store.ids() == ["b", "c", "a"]
    store.put(body("d"), USER, "out")
    assert store.ids() == ["c", "a", "d"]  # b, least recently used, went first
    assert store.get("b") is None and "b" not in store
    assert len(store) == 3


def test_byte_bound_and_accounting():
    one = size(body("a"), USER, "out")
    store = ResponseStore(max_entries=100, max_bytes=2 * one + 1)
    store.put(body("a"), USER, "out")
    store.put(body("b"), USER, "out")
    assert store.num_bytes == 2 * one and store.ids() == ["a", "b"]
    store.put(body("c"), USER, "out")
    assert store.ids() == ["b", "c"] and store.num_bytes == 2 * one
    big = body("e", pad="x" * (3 * one))
    assert not store.put(big, USER, "out")  # alone over the bound: not kept, nothing evicted
    assert store.ids() == ["b", "c"]
    # Replacing an id does not count it twice.
    store.put(body("b"), USER, "out")
    assert store.ids() == ["c", "b"] and store.num_bytes == 2 * one
    assert store.delete("c") and not store.delete("c")
    assert store.num_bytes == one and store.ids() == ["b"]


def test_conversation_and_disabled_store():
    store = ResponseStore()
    store.put(body("a"), [{"role": "user", "content": "q"}], "answer")
    assert store.get("a").conversation() == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "answer"},
    ]
    off = ResponseStore(max_entries=0)
    assert not off.put(body("a"), USER, "out") and len(off) == 0
    with pytest.raises(ValueError, match=">= 0"):
        ResponseStore(max_entries=-1)


def test_flags():
    from flowengine.entrypoints.openai.server import make_parser, options_from

    ns = make_parser().parse_args(
        ["--responses-store-max", "7", "--responses-store-max-bytes", "9"]
    )
    app = options_from(ns).app
    assert (app.responses_store_max, app.responses_store_max_bytes) == (7, 9)
    defaults = options_from(make_parser().parse_args([])).app
    assert (defaults.responses_store_max, defaults.responses_store_max_bytes) == (1000, 64 << 20)
    with pytest.raises(ValueError, match="--responses-store-max must be >= 0"):
        options_from(make_parser().parse_args(["--responses-store-max", "-1"]))
