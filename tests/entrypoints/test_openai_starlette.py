"""What the Starlette move added (issue 11 item 2): HEAD, GET /v1/models/{model}, the
CORS flags, --root-path, --middleware, and, through `flowengine serve`, --uds and
HTTPS (--ssl-certfile / --ssl-keyfile)."""

from __future__ import annotations

import datetime
import ipaddress
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from openai_fake_engine import FakeEngine
from openai_helpers import API_KEY, assert_error, strict
from openai_live_server import LiveServer

from flowengine.entrypoints.openai import responses as rs
from flowengine.entrypoints.openai.app import AppOptions
from flowengine.entrypoints.openai.server import main, make_parser, options_from

REPO = Path(__file__).resolve().parents[2]


def test_head_answers_every_get_route_without_a_body(server, http):
    for path in ("/health", "/version", "/v1/models", "/v1/models/alias", "/metrics",
                 "/openapi.json"):  # fmt: skip
        get = http.get(path)
        head = http.head(path)
        assert (head.status_code, head.content) == (200, b""), path
        assert head.headers.get("content-type") == get.headers.get("content-type"), path
        if path != "/metrics":  # the metrics body changes between the two calls
            assert int(head.headers["content-length"]) == len(get.content), path
    assert_error(httpx.get(f"{server.base_url}/v1/models"), 401)  # HEAD's GET needs the key
    assert httpx.head(f"{server.base_url}/v1/models").status_code == 401
    resp = http.head("/v1/completions")
    assert resp.status_code == 405 and resp.headers["allow"] == "POST"


def test_405_lists_get_and_head(http):
    resp = http.post("/v1/models", json={})
    assert_error(resp, 405, code="method_not_allowed")
    assert resp.headers["allow"] == "GET, HEAD"


def test_retrieve_model(client, http):
    assert client.models.retrieve("fake-model").id == "fake-model"
    card = strict(http.get("/v1/models/alias").content, rs.ModelCard)
    assert (card.id, card.root, card.max_model_len) == ("alias", "fake-model", 512)
    err = assert_error(http.get("/v1/models/gpt-9"), 404, code="model_not_found")
    assert "'gpt-9' does not exist" in err["message"]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")


def test_retrieve_model_with_a_slash_in_its_name():
    with LiveServer(FakeEngine(), model_names=("org/model-7b",)) as live:
        resp = httpx.get(f"{live.base_url}/v1/models/org/model-7b")
        assert resp.status_code == 200 and resp.json()["id"] == "org/model-7b"
        sdk = openai.OpenAI(base_url=f"{live.base_url}/v1", api_key="x", max_retries=0)
        assert sdk.models.retrieve("org/model-7b").id == "org/model-7b"


def test_trailing_slash_is_404_not_a_redirect(http):
    assert_error(http.get("/v1/models/"), 404, code="model_not_found")
    assert_error(http.get("/health/"), 404, code="not_found")


def test_cors_credentials_methods_and_headers():
    options = AppOptions(
        allowed_origins=("*",),
        allowed_methods=("GET",),
        allowed_headers=("authorization",),
        allow_credentials=True,
    )
    with LiveServer(FakeEngine(), app_options=options) as live:
        origin = {"origin": "https://ui.example"}
        resp = httpx.get(f"{live.base_url}/v1/models", headers=origin)
        # With credentials, "*" is not a wildcard for browsers: the origin is echoed.
        assert resp.headers["access-control-allow-origin"] == "https://ui.example"
        assert resp.headers["access-control-allow-credentials"] == "true"
        assert resp.headers["vary"] == "origin"
        # Errors carry the CORS headers too (the page can read the error).
        resp = httpx.post(f"{live.base_url}/v1/completions", json={}, headers=origin)
        assert resp.status_code == 400
        assert resp.headers["access-control-allow-origin"] == "https://ui.example"

        def preflight(path: str, method: str, headers: str) -> httpx.Response:
            return httpx.options(
                f"{live.base_url}{path}",
                headers={**origin, "access-control-request-method": method,
                         "access-control-request-headers": headers},
            )  # fmt: skip

        ok = preflight("/v1/models", "GET", "Authorization")
        assert ok.status_code == 204 and ok.headers["allow"] == "GET, HEAD, OPTIONS"
        assert ok.headers["access-control-allow-methods"] == "GET, OPTIONS"
        assert ok.headers["access-control-allow-headers"] == "authorization"
        assert ok.headers["access-control-allow-credentials"] == "true"
        assert ok.headers["access-control-max-age"] == "600"
        for refused in (
            preflight("/v1/chat/completions", "POST", "authorization"),  # POST not allowed
            preflight("/v1/models", "GET", "authorization, x-secret"),  # header not allowed
        ):
            assert refused.status_code == 204
            assert "access-control-allow-origin" not in refused.headers
            assert "access-control-allow-methods" not in refused.headers


def test_cors_any_origin_without_credentials_is_a_wildcard():
    options = AppOptions(allowed_origins=("*",))
    with LiveServer(FakeEngine(), app_options=options) as live:
        resp = httpx.get(f"{live.base_url}/health", headers={"origin": "https://a.example"})
        assert resp.headers["access-control-allow-origin"] == "*"
        assert "access-control-allow-credentials" not in resp.headers
        pre = httpx.options(
            f"{live.base_url}/v1/chat/completions",
            headers={"origin": "https://a.example", "access-control-request-method": "POST",
                     "access-control-request-headers": "x-anything"},
        )  # fmt: skip
        assert pre.headers["access-control-allow-methods"] == "POST, OPTIONS"
        assert pre.headers["access-control-allow-headers"] == "x-anything"


def test_root_path_behind_a_proxy():
    with LiveServer(FakeEngine(), app_options=AppOptions(root_path="/llm")) as live:
        for path in ("/llm/v1/models", "/v1/models"):  # proxied, and direct
            assert httpx.get(f"{live.base_url}{path}").status_code == 200, path
        doc = httpx.get(f"{live.base_url}/llm/openapi.json").json()
        assert doc["servers"] == [{"url": "/llm"}]
        sdk = openai.OpenAI(base_url=f"{live.base_url}/llm/v1", api_key="x", max_retries=0)
        r = sdk.completions.create(model="fake-model", prompt="abc", max_tokens=3, temperature=0)
        assert r.choices[0].text == "abc"
        assert_error(httpx.get(f"{live.base_url}/llm/nothing"), 404, code="not_found")


def test_middleware_class_and_function():
    from openai_test_middleware import SEEN_BODIES, SEEN_PATHS

    options = AppOptions(
        middleware=(
            "openai_test_middleware.StampMiddleware",
            "openai_test_middleware:stamp_dispatch",
        ),  # fmt: skip
    )
    with LiveServer(FakeEngine(), app_options=options) as live:
        resp = httpx.post(
            f"{live.base_url}/v1/completions",
            json={"prompt": "ab", "max_tokens": 2, "temperature": 0, "stream": True},
        )
        assert resp.status_code == 200 and resp.content.endswith(b"data: [DONE]\n\n")
        assert resp.headers["x-stamp"] == "class" and resp.headers["x-stamp-fn"] == "POST"
        # With user middleware every chunk of a stream passes through it (a stream's body
        # goes straight to the server only when there is none).
        assert b"".join(SEEN_BODIES) == resp.content and len(SEEN_BODIES) >= 4
        resp = httpx.get(f"{live.base_url}/nothing")  # errors pass through them too
        assert resp.status_code == 404 and resp.headers["x-stamp"] == "class"
    assert SEEN_PATHS[-2:] == ["/v1/completions", "/nothing"]


def test_middleware_flag_errors(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    ns = make_parser().parse_args(["--middleware", "openai_test_middleware.StampMiddleware"])
    assert options_from(ns).app.middleware == ("openai_test_middleware.StampMiddleware",)
    for bad in ("no_such_module.X", "openai_test_middleware.Missing",
                "openai_test_middleware.NOT_MIDDLEWARE"):  # fmt: skip
        assert main(["--middleware", bad]) == 2


def test_server_flags_for_http(tmp_path):
    ns = make_parser().parse_args(
        ["--allowed-methods", "GET", "POST", "--allowed-headers", '["authorization"]',
         "--allow-credentials", "--root-path", "/llm/", "--request-body-timeout", "0",
         "--header-timeout", "2.5", "--max-n", "4", "--max-request-tokens", "100",
         "--uds", str(tmp_path / "s.sock")]
    )  # fmt: skip
    opts = options_from(ns)
    assert opts.app.allowed_methods == ("GET", "POST")
    assert opts.app.allowed_headers == ("authorization",)
    assert opts.app.allow_credentials and opts.app.root_path == "/llm"
    assert opts.app.request_body_timeout_s is None  # 0: no limit
    assert (opts.header_timeout_s, opts.max_n, opts.max_request_tokens) == (2.5, 4, 100)
    assert opts.uds == str(tmp_path / "s.sock")
    defaults = options_from(make_parser().parse_args([]))
    assert defaults.app.request_body_timeout_s == 30.0 and defaults.max_queue_len is None
    assert defaults.app.allowed_methods == ("*",) and not defaults.app.allow_credentials
    for bad in (["--ssl-keyfile", "k.pem"], ["--ssl-certfile", "c", "--ssl-keyfile", "k"],
                ["--root-path", "llm"], ["--max-n", "0"], ["--header-timeout", "0"],
                ["--request-body-timeout", "-1"]):  # fmt: skip
        assert main(bad) == 2, bad


def _spawn(tmp_path: Path, *args: str) -> subprocess.Popen:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
        ),
        "FLOWENGINE_TEST_ENGINE": "openai_fake_engine:make_engine",
    }
    cmd = [sys.executable, "-m", "flowengine.entrypoints.cli", "serve", *args]
    log = open(tmp_path / "server.log", "wb")  # noqa: SIM115 - the process owns it
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)


def _wait(check, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the server exited"
        try:
            if check():
                return
        except (httpx.HTTPError, OSError):
            pass
        time.sleep(0.1)
    raise AssertionError("the server did not come up")


def _stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_serve_on_a_unix_socket(tmp_path):
    path = tmp_path / "flowengine.sock"
    proc = _spawn(tmp_path, "--uds", str(path), "--api-key", API_KEY)
    transport = httpx.HTTPTransport(uds=str(path))
    with httpx.Client(transport=transport, base_url="http://local", timeout=30) as c:
        _wait(lambda: c.get("/health").status_code == 200, proc)
        resp = c.post(
            "/v1/completions",
            json={"prompt": "abc", "max_tokens": 3, "temperature": 0},
            headers={"authorization": f"Bearer {API_KEY}"},
        )
        assert resp.json()["choices"][0]["text"] == "abc"
    assert _stop(proc) == 0
    assert not path.exists()  # removed on exit
    assert f"serving fake-model on http://unix:{path}" in (tmp_path / "server.log").read_text()


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def test_serve_https(tmp_path):
    cert, key = _self_signed(tmp_path)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = _spawn(
        tmp_path, "--port", str(port), "--ssl-certfile", str(cert), "--ssl-keyfile", str(key)
    )
    base = f"https://127.0.0.1:{port}"
    trust = ssl.create_default_context(cafile=str(cert))
    with httpx.Client(base_url=base, verify=trust, timeout=30) as c:
        _wait(lambda: c.get("/health").status_code == 200, proc)
        resp = c.post("/v1/completions", json={"prompt": "xyz", "max_tokens": 3, "temperature": 0})
        assert resp.json()["choices"][0]["text"] == "xyz"
    with pytest.raises(httpx.HTTPError):  # plain HTTP on the TLS port is refused
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).raise_for_status()
    assert _stop(proc) == 0
    assert (
        f"serving fake-model on https://127.0.0.1:{port}" in (tmp_path / "server.log").read_text()
    )
