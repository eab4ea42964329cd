"""Every wait of start-up and restart has a limit that ends in a clear error, and an
engine that can no longer serve ends the server process with exit code 1 (issue #21,
items 1 and 2), on the multiproc placement."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flowengine import SamplingParams
from flowengine.actors.procs import START_DELAY_ENV
from flowengine.actors.supervisor import SupervisorLimits
from flowengine.engine.protocol import EngineDeadError
from flowengine.entrypoints.async_engine import AsyncEngine
from flowengine.sampling_params import RequestOutputKind

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _segments_of(run_id: str) -> list[str]:
    prefix = f"fe-{run_id}-"
    return [f for f in os.listdir("/dev/shm") if f.startswith((prefix, "sem." + prefix))]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_start_up_that_is_not_ready_in_time_fails_clearly(default_model_path, monkeypatch):
    monkeypatch.setenv(START_DELAY_ENV, "60")  # the engine process would start 60 s late
    monkeypatch.setenv("FLOWENGINE_ENGINE_READY_TIMEOUT_S", "3")

    async def main():
        engine = AsyncEngine(default_model_path, max_model_len=256, placement="multiproc")
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match=(
                r"the engine group \(generation 0\) was not ready within 3 s; raise "
                "FLOWENGINE_ENGINE_READY_TIMEOUT_S")):
            await engine.start()
        assert time.monotonic() - t0 < 30  # 3 s after resolve and the tokenizer load
        sup = engine.supervisor
        assert not any(_alive(p) for pids in sup.pids.values() for p in pids)
        assert _segments_of(sup.run_id) == []

    asyncio.run(main())


def test_restart_that_is_not_ready_in_time_is_retried_then_the_engine_is_dead(
        default_model_path, monkeypatch):
    async def main():
        engine = AsyncEngine(default_model_path, max_model_len=256, placement="multiproc")
        await engine.start()
        deaths: list[EngineDeadError] = []
        engine.add_dead_callback(deaths.append)
        sup = engine.supervisor
        run_id = sup.run_id
        try:
            assert await _collect(engine) != ""
            # From now on every new engine process starts 60 s late, and a restart may
            # take 2 s: each restart times out; the second failure in a row is fatal.
            monkeypatch.setenv(START_DELAY_ENV, "60")
            sup.limits = SupervisorLimits(ready_timeout_s=2.0)
            sup.max_restarts = 2
            os.kill(sup.pids["engine"][0], signal.SIGKILL)
            t0 = time.monotonic()
            while not deaths:
                assert time.monotonic() - t0 < 60, "the engine never gave up"
                await asyncio.sleep(0.1)
            assert "failed 2 restarts in a row; giving up" in str(deaths[0])
            assert sup.num_restarts == 3
            with pytest.raises(EngineDeadError):
                await engine.check_health()
            with pytest.raises(EngineDeadError):
                await _collect(engine)
        finally:
            await engine.shutdown(drain_timeout_s=2)
        assert _segments_of(run_id) == []

    asyncio.run(main())


async def _collect(engine: AsyncEngine) -> str:
    text = ""
    async for out in engine.submit("Once upon a time", GREEDY, output_kind=RequestOutputKind.DELTA):
        text += out.outputs[0].text
    return text


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True,
                         text=True).stdout
    return [int(p) for p in out.split()]


def test_server_exits_non_zero_when_the_engine_is_dead(default_model_path, tmp_path):
    """`flowengine serve` whose engine cannot be restarted (OneLifeEngine) exits 1 after
    its engine process is killed, instead of staying up answering 503."""
    env = dict(os.environ)
    here = str(Path(__file__).parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    env["FLOWENGINE_TEST_ENGINE"] = "engine_hooks:one_life_engine"
    log = open(tmp_path / "serve.log", "w+")
    server = subprocess.Popen(
        [sys.executable, "-m", "flowengine.entrypoints.cli", "serve", default_model_path,
         "--placement", "multiproc", "--max-model-len", "256", "--port", str(_free_port())],
        env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while " on http://" not in (tmp_path / "serve.log").read_text():
            assert server.poll() is None, (tmp_path / "serve.log").read_text()
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        children = _children(server.pid)
        assert len(children) == 2  # engine + executor
        engine_pids = [p for p in children if b'"role":"engine"' in Path(
            f"/proc/{p}/cmdline").read_bytes()]
        assert len(engine_pids) == 1
        os.kill(engine_pids[0], signal.SIGKILL)
        assert server.wait(timeout=60) == 1
        assert "the engine cannot serve any more" in (tmp_path / "serve.log").read_text()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        log.close()
