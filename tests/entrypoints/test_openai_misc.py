"""/v1/models, /tokenize, /detokenize, /health, /version, /metrics, /openapi.json, CORS,
and what the request log holds."""

from __future__ import annotations

import logging

import httpx
import pytest
from openai_fake_engine import FakeEngine
from openai_helpers import assert_error, strict
from openai_live_server import LiveServer
from prometheus_client.parser import text_string_to_metric_families

import flowengine
from flowengine.entrypoints.openai import responses as rs
from flowengine.entrypoints.openai.app import AppOptions


def test_models(client, http):
    models = client.models.list()
    assert [m.id for m in models.data] == ["fake-model", "alias"]
    assert all(m.owned_by == "flowengine" for m in models.data)
    card = strict(http.get("/v1/models").content, rs.ModelList).data[1]
    assert (card.root, card.max_model_len) == ("fake-model", 512)


def test_model_cards_root_is_the_served_model_path_for_every_name(http, engine):
    """vLLM's `root`: the model as given to serve, not the first served name."""
    from types import SimpleNamespace

    engine.args = SimpleNamespace(model="/models/SmolLM2-135M-Instruct")
    try:
        cards = strict(http.get("/v1/models").content, rs.ModelList).data
        assert [(c.id, c.root) for c in cards] == [
            ("fake-model", "/models/SmolLM2-135M-Instruct"),
            ("alias", "/models/SmolLM2-135M-Instruct")]
        card = strict(http.get("/v1/models/alias").content, rs.ModelCard)
        assert card.root == "/models/SmolLM2-135M-Instruct"
    finally:
        del engine.args


def test_ping_answers_as_health_for_get_and_post(http, engine):
    """vLLM's /ping (SageMaker), GET and POST, without auth: 200, 503 once dead."""
    assert http.get("/ping").status_code == 200
    assert http.post("/ping").status_code == 200
    engine.dead = True
    try:
        assert http.get("/ping").status_code == 503
        assert http.post("/ping").status_code == 503
    finally:
        engine.dead = False


def test_tokenize_prompt_and_messages(http):
    body = strict(http.post("/tokenize", json={"prompt": "hi"}).content, rs.TokenizeResponse)
    assert (body.count, body.max_model_len, body.tokens, body.token_strs) == (
        2,
        512,
        [104, 105],
        None,
    )
    resp = http.post("/tokenize", json={"prompt": "hi", "return_token_strs": True})
    assert resp.json()["token_strs"] == ["h", "i"]
    resp = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
    assert resp.json()["tokens"] == list(b"user: hi\nassistant:")
    resp = http.post(
        "/tokenize",
        json={"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False},
    )
    assert resp.json()["count"] == len(b"user: hi\n")
    assert_error(http.post("/tokenize", json={"prompt": 3}), 400, param="prompt")
    assert_error(http.post("/tokenize", json={"prompt": "x", "model": "m"}), 404)


def test_detokenize(http):
    resp = http.post("/detokenize", json={"tokens": [104, 105]})
    assert strict(resp.content, rs.DetokenizeResponse).prompt == "hi"
    err = assert_error(http.post("/detokenize", json={"tokens": [104, 257]}), 400, param="tokens")
    assert err["message"] == "token id 257 is not in the tokenizer's vocabulary (ids 0..256)"
    assert_error(http.post("/detokenize", json={"tokens": [999]}), 400, param="tokens")
    assert_error(http.post("/detokenize", json={"tokens": [-1]}), 400, param="tokens[0]")


def test_health_and_version(server):
    resp = httpx.get(f"{server.base_url}/health")
    assert (resp.status_code, resp.content) == (200, b"")
    resp = httpx.get(f"{server.base_url}/version")
    assert strict(resp.content, rs.VersionResponse).version == flowengine.__version__


def test_metrics_after_requests(client, server, engine):
    for _ in range(2):
        client.completions.create(model="fake-model", prompt="abc", max_tokens=3, temperature=0)
    resp = httpx.get(f"{server.base_url}/metrics")
    assert resp.headers["content-type"] == server.server.metrics.content_type
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(resp.text)
        for s in fam.samples
    }
    model = ("model_name", "fake-model")
    # vLLM's labels: every metric names its model and its engine (sorted keys here).
    labels = (("engine", "0"), model)
    stats = engine.get_stats()
    assert (
        samples[("flowengine:generation_tokens_total", labels)] == stats.generation_tokens_total
    )
    assert samples[("flowengine:prompt_tokens_total", labels)] == stats.prompt_tokens_total
    assert samples[("flowengine:num_requests_running", labels)] == 0
    key = ("flowengine:request_success_total",
           (("engine", "0"), ("finished_reason", "length"), model))
    assert samples[key] == stats.finished_by_reason["length"]
    for name in ("time_to_first_token", "e2e_request_latency"):
        assert samples[(f"flowengine:{name}_seconds_count", labels)] >= 2
    # 3 tokens, one per step: 2 inter-token gaps per request at least.
    assert samples[("flowengine:inter_token_latency_seconds_count", labels)] >= 4
    expected = {"num_requests_waiting", "kv_cache_usage_perc", "num_preemptions_total",
                "prefix_cache_queries_total", "prefix_cache_hits_total"}  # fmt: skip
    assert expected <= {name.removeprefix("flowengine:") for name, _ in samples}


def test_openapi_describes_every_route(server):
    doc = httpx.get(f"{server.base_url}/openapi.json").json()
    assert doc["openapi"] == "3.1.0"
    routes = {(r.path, r.method.lower()) for r in server.server.app.router.routes}
    assert {(p, m) for p, ops in doc["paths"].items() for m in ops} == routes
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    ref = chat["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert ref == "#/components/schemas/ChatCompletionRequest"
    assert "text/event-stream" in chat["responses"]["200"]["content"]
    schema = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert schema["required"] == ["messages"]
    assert schema["properties"]["top_logprobs"]["anyOf"][0]["maximum"] == 20
    tok = doc["paths"]["/tokenize"]["post"]["requestBody"]["content"]["application/json"]
    assert len(tok["schema"]["oneOf"]) == 2
    assert chat["security"] == [{"bearer": []}]
    assert "security" not in doc["paths"]["/health"]["get"]
    validator = pytest.importorskip("openapi_spec_validator")
    validator.validate(doc)  # raises if the document is not valid OpenAPI 3.1


def test_cors_allowed_origin_and_preflight():
    options = AppOptions(allowed_origins=("https://ui.example",))
    with LiveServer(FakeEngine(), app_options=options) as live:
        url = f"{live.base_url}/v1/models"
        resp = httpx.get(url, headers={"origin": "https://ui.example"})
        assert resp.headers["access-control-allow-origin"] == "https://ui.example"
        resp = httpx.get(url, headers={"origin": "https://other.example"})
        assert "access-control-allow-origin" not in resp.headers
        resp = httpx.options(
            f"{live.base_url}/v1/chat/completions",
            headers={
                "origin": "https://ui.example",
                "access-control-request-method": "POST",
                "access-control-request-headers": "authorization, content-type",
            },
        )
        assert resp.status_code == 204
        assert resp.headers["access-control-allow-methods"] == "POST, OPTIONS"
        assert resp.headers["access-control-allow-headers"] == "authorization, content-type"
        assert resp.headers["access-control-allow-origin"] == "https://ui.example"
        assert httpx.options(f"{live.base_url}/nope").status_code == 404


def test_request_log_has_ids_counts_timings_but_no_prompt_text(client, caplog):
    secret = "zq-secret-prompt-7f3"
    with caplog.at_level(logging.INFO):
        r = client.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": secret}], max_tokens=30,
            temperature=0,
        )  # fmt: skip
        client.completions.create(model="fake-model", prompt=secret, max_tokens=2, stream=True)
    assert secret[:8] in r.choices[0].message.content  # the fake echoes it back
    assert secret not in caplog.text and secret[:8] not in caplog.text
    lines = [rec.getMessage() for rec in caplog.records if rec.name.endswith(".requests")]
    assert any(r.id in line and "prompt_tokens=" in line and "e2e=" in line for line in lines)
