"""`flowengine serve` as a process: systemd notifications, SIGTERM drain, exit codes,
and the example unit file."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import orjson
import pytest
from openai_helpers import assert_error

from flowengine.entrypoints.openai.notify import notify_address, sd_notify

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "examples" / "systemd" / "flowengine.service"
ENV_FILE = REPO / "examples" / "systemd" / "flowengine.env"


def env_file_values() -> dict[str, str]:
    """The assignments of the shipped environment file (comments skipped), as systemd's
    EnvironmentFile= reads them."""
    values = {}
    for line in ENV_FILE.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    return values


@pytest.fixture
def notify_socket():
    """A datagram socket in the abstract namespace, as `$NOTIFY_SOCKET` names it."""
    name = f"@flowengine-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(notify_address(name))
    sock.settimeout(30)
    yield name, sock
    sock.close()


def spawn_server(tmp_path: Path, notify_name: str, factory: str, *args: str) -> subprocess.Popen:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
        ),
        "FLOWENGINE_TEST_ENGINE": f"openai_fake_engine:{factory}",
        "FAKE_ENGINE_STEP_S": "0.02",
        "NOTIFY_SOCKET": notify_name,
    }
    cmd = [sys.executable, "-m", "flowengine.entrypoints.cli", "serve", "--port", "0", *args]
    log = open(tmp_path / "server.log", "wb")  # noqa: SIM115 - the process owns it
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)


def stream_completion(base_url: str, started: threading.Semaphore) -> tuple[str, str | None]:
    """(text, finish_reason) of one streamed completion; releases `started` at chunk 1."""
    text, finish, first = "", None, True
    req = {"prompt": "abcdef", "max_tokens": 60, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=req, timeout=60) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = orjson.loads(line[6:])["choices"][0]
            text += choice["text"]
            finish = choice["finish_reason"] or finish
            if first:
                started.release()
                first = False
    return text, finish


def test_ready_then_sigterm_drains_20_streams_and_exits_0(tmp_path, notify_socket):
    name, sock = notify_socket
    proc = spawn_server(tmp_path, name, "make_engine", "--graceful-timeout", "30")
    try:
        assert sock.recv(4096) == b"STATUS=loading the model"
        ready = sock.recv(4096).decode()
        assert ready.startswith("READY=1\nSTATUS=serving on 127.0.0.1:")
        base_url = f"http://127.0.0.1:{ready.rsplit(':', 1)[1]}"
        assert httpx.get(f"{base_url}/health").status_code == 200  # listening at READY

        started = threading.Semaphore(0)
        with ThreadPoolExecutor(20) as pool:
            futures = [pool.submit(stream_completion, base_url, started) for _ in range(20)]
            for _ in range(20):
                assert started.acquire(timeout=30)
            proc.send_signal(signal.SIGTERM)
            assert sock.recv(4096) == b"STOPPING=1\nSTATUS=draining in-flight requests"
            resp = httpx.post(f"{base_url}/v1/completions", json={"prompt": "x", "max_tokens": 1})
            assert_error(resp, 503, code="server_draining")
            assert resp.headers["retry-after"] == "5"
            results = [f.result(timeout=60) for f in futures]
        assert results == [(("abcdef" * 10), "length")] * 20
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = (tmp_path / "server.log").read_text()
    assert "TEST engine" in log and "draining: 20 requests in flight" in log
    assert "stopped" in log and "Traceback" not in log


def test_ipv6_host_is_logged_and_notified_in_brackets(tmp_path, notify_socket):
    """`--host ::1`: the log line and systemd's STATUS= name http://[::1]:PORT, a URL a
    client can use; they used to say http://::1:PORT (no brackets)."""
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    with socket.socket(socket.AF_INET6) as probe:
        try:
            probe.bind(("::1", 0))
        except OSError:
            pytest.skip("no IPv6 loopback")
    name, sock = notify_socket
    proc = spawn_server(tmp_path, name, "make_engine", "--host", "::1")
    try:
        assert sock.recv(4096) == b"STATUS=loading the model"
        ready = sock.recv(4096).decode()
        assert ready.startswith("READY=1\nSTATUS=serving on [::1]:")
        port = int(ready.rsplit(":", 1)[1])
        base_url = f"http://[::1]:{port}"
        assert httpx.get(f"{base_url}/health").status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert f"on {base_url}\n" in (tmp_path / "server.log").read_text()


def test_engine_load_failure_exits_1_without_ready(tmp_path, notify_socket):
    name, sock = notify_socket
    proc = spawn_server(tmp_path, name, "make_broken_engine")
    assert proc.wait(timeout=60) == 1
    assert sock.recv(4096) == b"STATUS=loading the model"
    sock.settimeout(0.2)
    with pytest.raises(TimeoutError):
        sock.recv(4096)  # never READY=1
    assert (
        "cannot start the engine: cannot load model 'missing'"
        in (tmp_path / "server.log").read_text()
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--no-such-flag",), "unrecognized arguments: --no-such-flag"),
        (("--port", "70000"), "--port must be in [0, 65535], got 70000"),
        (("/nonexistent/flowengine-model",), "no such file or directory: /nonexistent/"),
        (("./model.gguf",), "no such file or directory: ./model.gguf"),
    ],
)
def test_config_errors_exit_2_before_loading_and_the_unit_does_not_restart(
        tmp_path, notify_socket, args, message):
    """A wrong configuration exits with 2 (argparse's status) before anything loads, and
    the unit lists 2 in RestartPreventExitStatus=: a missing model path used to exit 1
    after "loading the model", which Restart=on-failure retried every 5 s forever."""
    name, sock = notify_socket
    proc = spawn_server(tmp_path, name, "make_engine", *args)
    assert proc.wait(timeout=60) == 2
    sock.settimeout(0.2)
    with pytest.raises(TimeoutError):
        sock.recv(4096)  # not even STATUS=loading the model
    log = (tmp_path / "server.log").read_text()
    assert message in log and "Traceback" not in log
    assert "\nRestartPreventExitStatus=2\n" in UNIT.read_text()


@pytest.mark.parametrize(
    ("template", "message"),
    [
        (None, "the chat template '{path}' looks like a file path, but it cannot be opened"),
        ("{% for m in messages %}{{ m.content }\n",
         "the chat template file '{path}' is not a valid Jinja template: unexpected '}' "
         "(line 1); fix it or give another --chat-template"),
    ],
    ids=["missing", "invalid"],
)
def test_bad_chat_template_fails_at_startup_with_one_line(tmp_path, notify_socket, template,
                                                          message):
    """A --chat-template that does not open or is not valid Jinja stops `serve` before
    loading, exit 2, one log line; an invalid one used to start the server and fail
    every chat request with 400 ("the chat template rejected these messages")."""
    path = tmp_path / "chat.jinja"
    if template is not None:
        path.write_text(template)
    name, sock = notify_socket
    proc = spawn_server(tmp_path, name, "make_engine", "--chat-template", str(path))
    assert proc.wait(timeout=60) == 2
    sock.settimeout(0.2)
    with pytest.raises(TimeoutError):
        sock.recv(4096)  # not even STATUS=loading the model
    (line,) = (tmp_path / "server.log").read_text().splitlines()
    expected = message.replace("{path}", str(path))
    assert f" ERROR flowengine.entrypoints.openai.server: {expected}" in line


def test_load_chat_template_rejects_invalid_jinja_and_keeps_valid_text(tmp_path):
    from flowengine.tokenize.chat import load_chat_template

    good = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    (tmp_path / "good.jinja").write_text(good)
    assert load_chat_template(str(tmp_path / "good.jinja")) == good
    assert load_chat_template("{{ bos_token }}\\n") == "{{ bos_token }}\n"  # escapes decoded
    hermes = REPO / "examples" / "templates" / "tool_chat_template_hermes.jinja"
    assert load_chat_template(str(hermes)) == hermes.read_text()
    with pytest.raises(ValueError, match=r"^the chat template text is not a valid Jinja "
                       r"template: Encountered unknown tag 'endif'\. .*\(line 1\)"):
        load_chat_template("{{ x }}{% endif %}")


def test_sd_notify_path_and_abstract_sockets(tmp_path):
    path = str(tmp_path / "n.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        assert sd_notify("READY=1", environ={"NOTIFY_SOCKET": path})
        assert sock.recv(64) == b"READY=1"
    assert notify_address("@abc") == b"\0abc"
    assert notify_address("/run/systemd/notify") == "/run/systemd/notify"
    assert not sd_notify("READY=1", environ={})
    assert not sd_notify("READY=1", environ={"NOTIFY_SOCKET": "relative"})
    assert not sd_notify("READY=1", environ={"NOTIFY_SOCKET": str(tmp_path / "gone.sock")})


def test_shipped_env_file_serves_loopback_only_and_ships_no_api_key():
    """Installed as-is, the example serves this machine only and holds no key: it used
    to bind 0.0.0.0 with FLOWENGINE_API_KEY=change-me, i.e. serve the world behind a
    key published in this repository."""
    import ipaddress

    from flowengine.entrypoints.openai.server import make_parser, options_from

    values = env_file_values()
    assert set(values) == {"FLOWENGINE_ARGS"}  # no FLOWENGINE_API_KEY assignment
    options = options_from(make_parser().parse_args(values["FLOWENGINE_ARGS"].split()))
    assert options.host == "127.0.0.1" and ipaddress.ip_address(options.host).is_loopback
    assert options.port == 8000


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_unit_file_passes_systemd_analyze_verify(tmp_path):
    text = UNIT.read_text()
    assert "ExecStart=/usr/local/bin/flowengine serve $FLOWENGINE_ARGS" in text
    # `verify` requires the ExecStart binary to exist; point it at this installation's.
    exe = shutil.which("flowengine") or sys.executable
    unit = tmp_path / "flowengine.service"
    unit.write_text(text.replace("/usr/local/bin/flowengine", exe))
    result = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == "" and result.stdout == ""  # no unknown keys, no warnings


def test_sigterm_drains_grpc_with_http(tmp_path, notify_socket):
    """With --grpc-port, the drain that SIGTERM starts covers gRPC too: new calls get
    UNAVAILABLE and health NOT_SERVING while HTTP drains (gRPC went on admitting calls
    and reporting SERVING until the HTTP drain had ended)."""
    grpc = pytest.importorskip("grpc")
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from flowengine.entrypoints.grpc import generate_pb2 as pb
    from flowengine.entrypoints.grpc import generate_pb2_grpc as pb_grpc

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        grpc_port = probe.getsockname()[1]
    name, sock = notify_socket
    proc = spawn_server(tmp_path, name, "make_engine", "--grpc-port", str(grpc_port))
    try:
        assert sock.recv(4096) == b"STATUS=loading the model"
        base_url = f"http://127.0.0.1:{sock.recv(4096).decode().rsplit(':', 1)[1]}"
        channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
        stub = pb_grpc.GenerateStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        request = pb.GenerateRequest(text="ab", sampling_params=pb.SamplingParams(
            temperature=0.0, max_tokens=2))
        assert stub.Generate(request, timeout=30).text == "ab"
        started = threading.Semaphore(0)
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(stream_completion, base_url, started)
            assert started.acquire(timeout=30)
            proc.send_signal(signal.SIGTERM)
            assert sock.recv(4096) == b"STOPPING=1\nSTATUS=draining in-flight requests"
            with pytest.raises(grpc.RpcError) as err:
                stub.Generate(request, timeout=30)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            check = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=30)
            assert check.status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert future.result(timeout=60) == ("abcdef" * 10, "length")
        channel.close()
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "Traceback" not in (tmp_path / "server.log").read_text()
