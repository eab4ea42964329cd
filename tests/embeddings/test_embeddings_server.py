"""/v1/embeddings through the official `openai` SDK against a live server: in process
(inproc placement) and as `flowengine serve --placement multiproc` in its own process
(frontend, engine and executor processes over shared-memory rings). Bad input is a 400
in OpenAI's error shape and the server keeps serving."""

from __future__ import annotations

import base64
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "entrypoints"))
from openai_live_server import LiveServer  # noqa: E402

TEXTS = ["A man is eating food.", "A monkey is playing drums.", "Embeddings map text to vectors."]


@pytest.fixture(scope="module")
def reference(minilm_path):
    from flowengine import LLM

    llm = LLM(minilm_path)
    vecs = np.array([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
    ids = [llm.get_tokenizer().encode(t) for t in TEXTS]
    return vecs, ids


@pytest.fixture(scope="module")
def live(minilm_path):
    from flowengine.entrypoints.async_engine import AsyncEngine

    engine = AsyncEngine(minilm_path)
    server = LiveServer(engine, manage_engine=True).start(timeout_s=300)
    try:
        yield server
    finally:
        server.stop(timeout_s=60)


def _check_embeddings(base_url: str, model: str, reference) -> None:
    vecs, ids = reference
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)
    # The SDK asks for base64 by default and decodes it to floats itself.
    resp = client.embeddings.create(model=model, input=TEXTS)
    assert [d.index for d in resp.data] == [0, 1, 2]
    got = np.array([d.embedding for d in resp.data])
    np.testing.assert_allclose(got, vecs, atol=1e-6)
    assert resp.usage.prompt_tokens == resp.usage.total_tokens == sum(len(i) for i in ids)
    assert resp.model == model and resp.object == "list"
    floats = client.embeddings.create(model=model, input=TEXTS[0], encoding_format="float")
    np.testing.assert_allclose(floats.data[0].embedding, vecs[0], atol=1e-6)
    by_ids = client.embeddings.create(model=model, input=ids[1], encoding_format="float")
    np.testing.assert_allclose(by_ids.data[0].embedding, vecs[1], atol=1e-6)
    many_ids = client.embeddings.create(model=model, input=ids, encoding_format="float")
    np.testing.assert_allclose([d.embedding for d in many_ids.data], vecs, atol=1e-6)
    # Raw wire format of base64: float32 little-endian bytes.
    raw = httpx.post(f"{base_url}/v1/embeddings", timeout=60,
                     json={"input": TEXTS[2], "encoding_format": "base64"}).json()
    assert set(raw) == {"id", "object", "created", "model", "data", "usage"}
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(decoded, vecs[2], atol=1e-6)


def _check_bad_input(base_url: str, model: str) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="matryoshka"):
        client.embeddings.create(model=model, input="hi", dimensions=64)
    with pytest.raises(openai.BadRequestError, match="max_model_len is 256"):
        client.embeddings.create(model=model, input="word " * 400)
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.embeddings.create(model=model, input=[101, 99999999, 102])
    with pytest.raises(openai.BadRequestError, match="empty"):
        client.embeddings.create(model=model, input=[])
    with pytest.raises(openai.BadRequestError, match="encoding_format"):
        client.embeddings.create(model=model, input="hi", encoding_format="int8")  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError, match="at most 2048"):
        client.embeddings.create(model=model, input=["a"] * 2049)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="hi")
    # Generation routes on an embedding model: 400 in OpenAI's error shape.
    with pytest.raises(openai.BadRequestError, match="embeddings only"):
        client.completions.create(model=model, prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="embeddings only"):
        client.chat.completions.create(model=model, max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}])
    resp = httpx.post(f"{base_url}/v1/embeddings", json={"input": "hi", "dimensions": 8},
                      timeout=60)
    assert resp.status_code == 400
    assert set(resp.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(f"{base_url}/health", timeout=30).status_code == 200


def test_embeddings_through_the_openai_sdk_in_process(live, reference):
    model = live.engine.model_name
    _check_embeddings(live.base_url, model, reference)
    _check_bad_input(live.base_url, model)
    _check_embeddings(live.base_url, model, reference)  # still serving, same vectors
    stats = live.engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_embeddings_on_a_generation_model_are_a_400(default_model_path):
    from flowengine.entrypoints.async_engine import AsyncEngine

    engine = AsyncEngine(default_model_path, max_model_len=256, num_kv_blocks=64)
    server = LiveServer(engine, manage_engine=True).start(timeout_s=300)
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="does not support the Embeddings API"):
            client.embeddings.create(model=engine.model_name, input="hi")
        out = client.completions.create(model=engine.model_name, prompt="hi", max_tokens=2,
                                        temperature=0)
        assert out.usage.completion_tokens == 2
    finally:
        server.stop(timeout_s=60)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_embeddings_through_flowengine_serve_multiproc(minilm_path, reference, tmp_path):
    port = _free_port()
    log = open(tmp_path / "server.log", "wb")  # noqa: SIM115 - the process owns it
    server = subprocess.Popen(
        [sys.executable, "-m", "flowengine.entrypoints.cli", "serve", minilm_path,
         "--port", str(port), "--placement", "multiproc", "--served-model-name", "minilm"],
        env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=log, stderr=subprocess.STDOUT,
        cwd=REPO,
    )
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        _check_embeddings(base_url, "minilm", reference)
        _check_bad_input(base_url, "minilm")
        _check_embeddings(base_url, "minilm", reference)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            assert server.wait(timeout=60) == 0, (tmp_path / "server.log").read_text()[-3000:]
        finally:
            if server.poll() is None:
                server.kill()
