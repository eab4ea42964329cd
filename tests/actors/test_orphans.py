"""Engine and executor processes exit when their frontend dies, and ignore Ctrl-C
(the frontend drains and stops them)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from flowengine.shm import cleanup_stale

pytestmark = pytest.mark.slow

FRONTEND = """
from flowengine import LLM
llm = LLM({model!r}, placement="multiproc", max_model_len=256)
print("ready", flush=True)
import time
time.sleep(600)
"""


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True,
                         text=True).stdout
    return [int(p) for p in out.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purpose (its parent, init, reaps it).
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def test_killed_frontend_takes_its_engine_processes_along(default_model_path: str) -> None:
    frontend = subprocess.Popen([sys.executable, "-c", FRONTEND.format(model=default_model_path)],
                                stdout=subprocess.PIPE, text=True)
    try:
        assert frontend.stdout is not None and frontend.stdout.readline().strip() == "ready"
        children = _children(frontend.pid)
        assert len(children) == 2  # engine + one executor
        for pid in children:  # Ctrl-C in a terminal reaches them too: ignored
            os.kill(pid, signal.SIGINT)
        time.sleep(1.5)
        assert all(_alive(pid) for pid in children)
        frontend.kill()
        frontend.wait()
        deadline = time.monotonic() + 15
        while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(pid) for pid in children)
    finally:
        if frontend.poll() is None:
            frontend.kill()
            frontend.wait()
    # The dead frontend's rings: what the next engine start removes.
    assert any(name.endswith("-steps") for name in cleanup_stale())
