"""schemathesis against /openapi.json (issue 21): every route, `--checks all`, over the
fake engine. No 5xx, no response outside its documented status / content type /
schema, invalid data refused, auth enforced; the server healthy after.

The CI run is bounded (`MAX_EXAMPLES` per operation and phase: ~1,600 cases in about
a minute on the 2-core machine); FLOWENGINE_SCHEMATHESIS_EXAMPLES raises it
for a longer run.
"""

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
from openai_helpers import API_KEY

REPO = Path(__file__).resolve().parents[2]
CONFIG = Path(__file__).with_name("schemathesis.toml")
MAX_EXAMPLES = int(os.environ.get("FLOWENGINE_SCHEMATHESIS_EXAMPLES", "30"))
MIN_CASES = 1000


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_schemathesis_all_checks_all_routes(tmp_path):
    # `flowengine serve` itself (uvloop, its own process), serving the fake engine.
    port = _free_port()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
        ),
        "FLOWENGINE_TEST_ENGINE": "openai_fake_engine:make_engine",
        "FAKE_ENGINE_STEP_S": "0.0005",
        "FLOWENGINE_API_KEY": API_KEY,
    }
    log = open(tmp_path / "server.log", "wb")  # noqa: SIM115 - the process owns it
    server = subprocess.Popen(
        [sys.executable, "-m", "flowengine.entrypoints.cli", "serve", "--port", str(port),
         "--disable-log-requests", "--max-request-body-bytes", str(1 << 20)],
        env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
    )  # fmt: skip
    base_url = f"http://127.0.0.1:{port}"
    auth = {"authorization": f"Bearer {API_KEY}"}
    try:
        deadline = time.monotonic() + 60
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.1)
        cmd = [
            sys.executable, "-m", "schemathesis.cli", "--config-file", str(CONFIG), "run",
            f"{base_url}/openapi.json", "--checks", "all",
            "--max-examples", str(MAX_EXAMPLES), "--seed", "21",
            "--header", f"Authorization: Bearer {API_KEY}",
            "--request-timeout", "60", "--continue-on-failure", "--no-color",
        ]  # fmt: skip
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
        out = run.stdout + run.stderr
        assert run.returncode == 0, out[-6000:]
        # Every operation is tested (schemathesis leaves out the document's own route);
        # the count comes from the document, so a new route is covered without edits.
        paths = httpx.get(f"{base_url}/openapi.json", headers=auth).json()["paths"]
        num_ops = sum(len(ops) for path, ops in paths.items() if path != "/openapi.json")
        assert num_ops >= 15  # 9 before issue 17; /v1/embeddings; the 5 front-door operations
        selected = re.search(r"Selected: (\d+)/(\d+)", out)
        assert selected and selected.group(1) == selected.group(2) == str(num_ops), out[-3000:]
        assert f"Tested: {num_ops}" in out
        generated = re.search(r"(\d+) generated, (\d+) passed", out)
        assert generated and int(generated.group(1)) >= MIN_CASES, out[-3000:]
        assert generated.group(1) == generated.group(2)
        # Healthy after: it answers, exactly.
        assert httpx.get(f"{base_url}/health").status_code == 200
        resp = httpx.post(
            f"{base_url}/v1/completions",
            json={"prompt": "abc", "max_tokens": 3, "temperature": 0},
            headers=auth,
            timeout=30,
        )
        assert resp.json()["choices"][0]["text"] == "abc"
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            assert server.wait(timeout=60) == 0
        finally:
            if server.poll() is None:
                server.kill()
    text = (tmp_path / "server.log").read_text()
    assert "Traceback" not in text and " 500 " not in text
