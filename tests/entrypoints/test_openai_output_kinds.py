"""The OpenAI routes ask the engine for the output kind they need: one FINAL_ONLY
output for a non-streaming request, DELTA outputs for an SSE stream; the latency
histograms of /metrics come from the engine either way."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from flowengine.sampling_params import RequestOutputKind


def _record_kinds(engine, monkeypatch) -> list[RequestOutputKind | None]:
    kinds: list[RequestOutputKind | None] = []
    submit = engine.submit

    def recording(*args, output_kind=None, **kwargs):
        kinds.append(output_kind)
        return submit(*args, output_kind=output_kind, **kwargs)

    monkeypatch.setattr(engine, "submit", recording)
    return kinds


def _count(server, name: str) -> float:
    text = httpx.get(f"{server.base_url}/metrics").text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == f"flowengine:{name}":
                return s.value
    raise AssertionError(f"no {name}")


def test_non_streaming_routes_ask_for_final_only(client, server, engine, monkeypatch):
    kinds = _record_kinds(engine, monkeypatch)
    itl_before = _count(server, "inter_token_latency_seconds_count")
    ttft_before = _count(server, "time_to_first_token_seconds_count")
    out = client.completions.create(model="fake-model", prompt="abcd", max_tokens=4,
                                    temperature=0, n=2)
    # the fake echoes the prompt from each sample's index on
    assert [c.text for c in out.choices] == ["abcd", "bcda"]
    assert out.usage.completion_tokens == 8
    chat = client.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        temperature=0)
    assert chat.usage.completion_tokens == 3 and chat.choices[0].finish_reason == "length"
    assert kinds == [RequestOutputKind.FINAL_ONLY, RequestOutputKind.FINAL_ONLY]
    # The engine's statistics still see every step: 2 samples x 3 gaps, then 2 gaps;
    # one first token per sample.
    assert _count(server, "inter_token_latency_seconds_count") == itl_before + 2 * 3 + 2
    assert _count(server, "time_to_first_token_seconds_count") == ttft_before + 3


def test_streaming_routes_ask_for_deltas(client, engine, monkeypatch):
    kinds = _record_kinds(engine, monkeypatch)
    chunks = list(client.completions.create(model="fake-model", prompt="abc", max_tokens=3,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == "abc"
    with client.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
            temperature=0, stream=True) as stream:
        assert sum(1 for _ in stream) >= 2
    assert kinds == [RequestOutputKind.DELTA, RequestOutputKind.DELTA]
