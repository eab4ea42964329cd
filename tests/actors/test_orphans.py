"""Engine and executor processes exit when their frontend dies, removing the dead
frontend's ring segments and semaphores as they go (issue #21 item 7), and ignore
Ctrl-C (the frontend drains and stops them)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow

FRONTEND = """
from flowengine import LLM
llm = LLM({model!r}, placement="multiproc", max_model_len=256)
print("ready", llm._background.engine.supervisor.run_id, flush=True)
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
        assert frontend.stdout is not None
        word, run_id = frontend.stdout.readline().split()
        assert word == "ready"
        prefix = f"fe-{run_id}-"

        def run_entries() -> list[str]:
            return [e for e in os.listdir("/dev/shm") if e.startswith((prefix, "sem." + prefix))]

        assert len([e for e in run_entries() if e.startswith(prefix)]) == 4  # the rings
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
        # The children removed the dead frontend's segments and semaphores on their way
        # out (not left for the next start's cleanup_stale).
        while run_entries() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert run_entries() == []
    finally:
        if frontend.poll() is None:
            frontend.kill()
            frontend.wait()
