"""`flowengine serve --grpc-port N` (issue 17 item 3 acceptance): a client generated
from proto/flowengine/v1/generate.proto calls unary Generate and server-streaming
GenerateStream beside HTTP on the same engine; texts equal the HTTP route's greedy
text; cancelling a call frees its KV blocks (the engine's /metrics); grpc.health.v1
answers; bad input is INVALID_ARGUMENT (or NOT_FOUND) and the engine keeps serving."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("grpc_tools")
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PROMPT = "The capital of France is"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def stubs(tmp_path_factory):
    """Client stubs generated here from the .proto (not the server's committed ones)."""
    from grpc_tools import protoc

    out = tmp_path_factory.mktemp("client_stubs")
    assert protoc.main(["protoc", f"-I{REPO / 'proto'}", f"--python_out={out}",
                        f"--grpc_python_out={out}",
                        str(REPO / "proto/flowengine/v1/generate.proto")]) == 0
    # protoc's module path is flowengine/v1/; load it under its own top-level name so
    # it cannot shadow the flowengine package.
    v1 = out / "flowengine" / "v1"
    pkg = out / "client_v1"
    pkg.mkdir()
    for name in ("generate_pb2.py", "generate_pb2_grpc.py"):
        text = (v1 / name).read_text().replace("from flowengine.v1 import", "from client_v1 import")
        (pkg / name).write_text(text)
    (pkg / "__init__.py").write_text("")
    sys.path.insert(0, str(out))
    import importlib

    # The server process registers the same .proto file name; this test process does
    # not import the server's stubs, so the client's descriptor pool stays its own.
    pb = importlib.import_module("client_v1.generate_pb2")
    pb_grpc = importlib.import_module("client_v1.generate_pb2_grpc")
    return pb, pb_grpc


@pytest.fixture(scope="module")
def served(default_model_path, tmp_path_factory):
    port, grpc_port = _free_port(), _free_port()
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    log = open(log_path, "wb")  # noqa: SIM115 - the process owns it
    proc = subprocess.Popen(
        [sys.executable, "-m", "flowengine.entrypoints.cli", "serve", default_model_path,
         "--port", str(port), "--grpc-port", str(grpc_port), "--max-model-len", "512",
         "--num-kv-blocks", "128", "--served-model-name", "smol", "--disable-log-stats"],
        env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=log, stderr=subprocess.STDOUT,
        cwd=REPO,
    )
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            try:
                if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
        grpc.channel_ready_future(channel).result(timeout=60)
        yield base_url, channel
        channel.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(timeout=60) == 0, log_path.read_text()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()


def _http_greedy(base_url: str, prompt, max_tokens: int) -> dict:
    resp = httpx.post(f"{base_url}/v1/completions", timeout=120, json={
        "model": "smol", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert resp.status_code == 200, resp.text
    return resp.json()


def _gauge(base_url: str, name: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    match = re.search(rf"^flowengine:{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert match, name
    return float(match.group(1))


def _wait_kv_free(base_url: str, what: str) -> None:
    deadline = time.monotonic() + 60
    while _gauge(base_url, "kv_cache_usage_perc") != 0.0 or _gauge(
            base_url, "num_requests_running") != 0.0:
        assert time.monotonic() < deadline, f"the KV blocks of {what} were not freed"
        time.sleep(0.05)


def test_unary_and_stream_equal_http_greedy(served, stubs):
    base_url, channel = served
    pb, pb_grpc = stubs
    stub = pb_grpc.GenerateStub(channel)
    params = pb.SamplingParams(temperature=0.0, max_tokens=12)
    unary = stub.Generate(pb.GenerateRequest(text=PROMPT, sampling_params=params), timeout=120)
    http = _http_greedy(base_url, PROMPT, 12)
    assert unary.text == http["choices"][0]["text"]
    assert unary.finish_reason == http["choices"][0]["finish_reason"] == "length"
    assert len(unary.token_ids) == 12
    assert unary.usage.prompt_tokens == http["usage"]["prompt_tokens"]
    assert unary.usage.completion_tokens == 12
    assert unary.request_id.startswith("grpc-")
    chunks = list(stub.GenerateStream(pb.GenerateRequest(text=PROMPT, sampling_params=params,
                                                         request_id="stream-1"), timeout=120))
    assert len(chunks) >= 2
    assert "".join(c.text for c in chunks) == unary.text
    assert [t for c in chunks for t in c.token_ids] == list(unary.token_ids)
    assert all(c.request_id == "stream-1" for c in chunks)
    assert [c.finish_reason for c in chunks[:-1]] == [""] * (len(chunks) - 1)
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 12
    # Token ids in, the same completion out (and equal to HTTP on token ids).
    ids = httpx.post(f"{base_url}/tokenize", json={"prompt": PROMPT}, timeout=30).json()["tokens"]
    by_ids = stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids),
                                              sampling_params=params, model="smol"), timeout=120)
    http_ids = _http_greedy(base_url, ids, 12)
    assert by_ids.text == http_ids["choices"][0]["text"]
    assert list(by_ids.token_ids) == list(unary.token_ids)


def test_stop_string_and_reason(served, stubs):
    base_url, channel = served
    pb, pb_grpc = stubs
    stub = pb_grpc.GenerateStub(channel)
    full = stub.Generate(pb.GenerateRequest(
        text=PROMPT, sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=12)))
    word = full.text.split()[1]
    out = stub.Generate(pb.GenerateRequest(text=PROMPT, sampling_params=pb.SamplingParams(
        temperature=0.0, max_tokens=12, stop=[word])), timeout=120)
    assert out.finish_reason == "stop" and out.stop_string == word
    assert out.text == full.text[:full.text.index(word)]


def test_cancel_frees_kv_blocks(served, stubs):
    base_url, channel = served
    pb, pb_grpc = stubs
    stub = pb_grpc.GenerateStub(channel)
    _wait_kv_free(base_url, "earlier requests")  # a stop string's abort lands after its reply
    call = stub.GenerateStream(pb.GenerateRequest(
        text=PROMPT, sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=450,
                                                       ignore_eos=True)), timeout=300)
    got = [next(call) for _ in range(3)]
    assert all(not c.finish_reason for c in got)
    deadline = time.monotonic() + 30
    while _gauge(base_url, "num_requests_running") != 1.0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert _gauge(base_url, "kv_cache_usage_perc") > 0.0
    call.cancel()
    with pytest.raises(grpc.RpcError) as err:
        for _ in call:
            pass
    assert err.value.code() == grpc.StatusCode.CANCELLED
    _wait_kv_free(base_url, "the cancelled call")
    # A deadline that passes cancels too.
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(pb.GenerateRequest(text=PROMPT, sampling_params=pb.SamplingParams(
            temperature=0.0, max_tokens=450, ignore_eos=True)), timeout=0.5)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _wait_kv_free(base_url, "the timed-out call")


def test_health_check(served):
    _, channel = served
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "flowengine.v1.Generate"):
        resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=30)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as err:
        health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=30)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize(("fields", "code", "message"), [
    ({}, "INVALID_ARGUMENT", "no prompt"),
    ({"text": ""}, "INVALID_ARGUMENT", "empty"),
    ({"text": "word " * 600}, "INVALID_ARGUMENT", "max_model_len"),
    ({"token_ids": [1, 10**9]}, "INVALID_ARGUMENT", "outside the vocabulary"),
    ({"text": "hi", "temperature": -1.0}, "INVALID_ARGUMENT", "temperature"),
    ({"text": "hi", "top_p": 0.0}, "INVALID_ARGUMENT", "top_p"),
    ({"text": "hi", "model": "nope"}, "NOT_FOUND", "does not exist"),
])
def test_bad_input_is_a_status_and_the_engine_keeps_serving(served, stubs, fields, code, message):
    base_url, channel = served
    pb, pb_grpc = stubs
    stub = pb_grpc.GenerateStub(channel)
    kwargs = {}
    if "text" in fields:
        kwargs["text"] = fields["text"]
    if "token_ids" in fields:
        kwargs["token_ids"] = pb.TokenIds(ids=fields["token_ids"])
    sampling = {k: fields[k] for k in ("temperature", "top_p") if k in fields}
    request = pb.GenerateRequest(model=fields.get("model", ""),
                                 sampling_params=pb.SamplingParams(max_tokens=2, **sampling),
                                 **kwargs)
    for call in (stub.Generate, lambda r, timeout: list(stub.GenerateStream(r, timeout=timeout))):
        with pytest.raises(grpc.RpcError) as err:
            call(request, timeout=60)
        assert err.value.code() == getattr(grpc.StatusCode, code)
        assert message in err.value.details()
    out = stub.Generate(pb.GenerateRequest(
        text=PROMPT, sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=3)), timeout=60)
    assert len(out.token_ids) == 3
    assert httpx.get(f"{base_url}/health", timeout=30).status_code == 200
