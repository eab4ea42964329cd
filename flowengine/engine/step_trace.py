"""Per-step timestamps across the engine's processes, for finding where a step waits.

Off unless `FLOWENGINE_STEP_TRACE` names a directory. Then each process that marks
events writes them, when it exits, to `DIR/ROLE-PID.json`: a list of
`[event, step_id, t_ns, value]` (value: an event's count, e.g. a plan's rows) with `t_ns` from `time.monotonic_ns()` (CLOCK_MONOTONIC, one
clock for every process of the host, so the files merge into one timeline).
`benchmarks/step_trace.py` joins them per step. The scheduler and executor actors
mark a plan's send and receipt, the launch of its forward and sampling, a grammar
bitmask's fill, send and receipt, and a result's resolution, send and receipt.

A mark costs one flag test when tracing is off, and a tuple append when on (a run is
bounded by MAX_EVENTS per process, later events are dropped).
"""

from __future__ import annotations

import atexit
import os
import time

import orjson

MAX_EVENTS = 2_000_000

_DIR = os.environ.get("FLOWENGINE_STEP_TRACE") or None
ENABLED = _DIR is not None
_events: list[tuple[str, int, int, int]] = []
_role = "process"
_registered = False


def start(role: str) -> None:
    """Name this process's trace file (`role`: e.g. "engine", "executor") and write
    the file at exit. A no-op when tracing is off."""
    global _role, _registered
    if not ENABLED:
        return
    _role = role
    if not _registered:
        atexit.register(dump)
        _registered = True


def mark(event: str, step_id: int, value: int = 0) -> None:
    """Record `event` of step `step_id` now (call only when ENABLED)."""
    if len(_events) < MAX_EVENTS:
        _events.append((event, step_id, time.monotonic_ns(), value))


def dump() -> str | None:
    """Write this process's events (see the module docstring); the file's path, or
    None when tracing is off or nothing was marked."""
    if not ENABLED or not _events:
        return None
    os.makedirs(_DIR, exist_ok=True)  # type: ignore[arg-type]
    path = os.path.join(_DIR, f"{_role}-{os.getpid()}.json")  # type: ignore[arg-type]
    with open(path, "wb") as f:
        f.write(orjson.dumps(_events))
    _events.clear()
    return path
