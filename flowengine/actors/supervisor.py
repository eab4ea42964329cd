"""Supervisor: starts, watches and restarts the engine and executor processes (DESIGN.md §8).

It lives in the frontend process and owns the four ring segments (created 0600 under a
random run id, unlinked on exit; stale ones of crashed runs removed at start). The
engine process and the executor processes (one per tensor-parallel rank) form one
group: when any of them dies, the whole group is restarted, and every request in
flight is recomputed from its prompt plus the tokens already delivered, so callers see
a delay, not an error, and no token twice.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import msgspec

from flowengine.actors.procs import ProcConfig, RingNames
from flowengine.engine.protocol import EngineDeadError
from flowengine.messages import EngineOutputs, NewRequest, RequestsMsg
from flowengine.shm import (
    Channel,
    RingReader,
    RingWriter,
    cleanup_stale,
    create_broadcast_ring,
    create_ring,
    new_run_id,
)

logger = logging.getLogger(__name__)

# Ring sizes: a step plan carries new requests in full (a 100k-token prompt is ~300 KB
# of msgpack), so "steps" and "requests" get the most room.
RING_BYTES = {"requests": 16 << 20, "outputs": 16 << 20, "steps": 32 << 20, "results": 8 << 20}
POLL_INTERVAL_S = 0.1
READY_TIMEOUT_S = 900.0  # loading a large model from disk


class Supervisor:
    """Owns the rings and the engine/executor process group.

    Args:
        resolved: the engine's resolved configuration (`flowengine.engine.builder`).
        expect_generation: called with a new generation number before a restarted
            group starts; returns an event set when that generation's ready message
            reaches the frontend (the Detokenizer actor's `expect_generation`).
        resubmit: returns the `NewRequest`s that recompute every live request.
        max_restarts: restarts allowed before the engine is declared dead.
    """

    def __init__(
        self,
        resolved: Any,
        expect_generation: Callable[[int], Any],
        resubmit: Callable[[], list[NewRequest]],
        *,
        max_restarts: int = 20,
    ) -> None:
        self.resolved = resolved
        self._expect_generation = expect_generation
        self._resubmit = resubmit
        self.max_restarts = max_restarts
        self.num_restarts = 0
        self.generation = 0
        self._procs: list[subprocess.Popen] = []
        self._segments: list[Any] = []
        self._stopping = False

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Create the rings, start the group and wait until it is ready."""
        cleanup_stale()
        self.run_id = new_run_id()
        tp = self.resolved.args.tensor_parallel_size
        segs = {
            "requests": create_ring("requests", RING_BYTES["requests"], run_id=self.run_id),
            "outputs": create_ring("outputs", RING_BYTES["outputs"], run_id=self.run_id),
            "steps": create_broadcast_ring("steps", tp, RING_BYTES["steps"], run_id=self.run_id),
            "results": create_ring("results", RING_BYTES["results"], run_id=self.run_id),
        }
        self._segments = list(segs.values())
        self.rings = RingNames(**{k: v.name for k, v in segs.items()})
        self.requests = Channel(RingWriter.attach(self.rings.requests), RequestsMsg)
        self.outputs = Channel(RingReader.attach(self.rings.outputs), EngineOutputs)
        self._spawn_group()
        first = await self._wait_ready_message()
        if first.generation != 0:
            raise RuntimeError(f"unexpected engine generation {first.generation} at start")

    async def _wait_ready_message(self) -> EngineOutputs:
        recv = asyncio.ensure_future(self.outputs.recv_async())
        try:
            while not recv.done():
                dead = self._dead_procs()
                if dead:
                    raise EngineDeadError(f"engine processes exited during start: {dead}")
                await asyncio.wait([recv], timeout=POLL_INTERVAL_S)
            return recv.result()
        finally:
            recv.cancel()

    def _spawn_group(self) -> None:
        tp = self.resolved.args.tensor_parallel_size
        roles = [("executor", rank) for rank in range(tp)] + [("engine", 0)]
        env = dict(os.environ)
        # A fresh rendezvous per group: a restarted group must not meet the old one.
        dist_init_method = f"tcp://127.0.0.1:{free_port()}" if tp > 1 else ""
        self._procs = []
        for role, rank in roles:
            cfg = ProcConfig(role, self.resolved.args, self.rings, rank, self.generation,
                             dist_init_method)
            cmd = [sys.executable, "-m", "flowengine.actors.procs", msgspec.json.encode(cfg).decode()]
            self._procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL))
        logger.info("generation %d: started pids %s", self.generation,
                    [p.pid for p in self._procs])

    def _dead_procs(self) -> list[tuple[int, int]]:
        return [(p.pid, p.returncode) for p in self._procs if p.poll() is not None]

    @property
    def pids(self) -> dict[str, list[int]]:
        """{"engine": [pid], "executor": [pid per rank]} of the current group."""
        return {"executor": [p.pid for p in self._procs[:-1]], "engine": [self._procs[-1].pid]}

    # ------------------------------------------------------------------ watching
    async def run(self) -> None:
        """Watch the group; restart it when a process dies. Raises EngineDeadError
        after `max_restarts` restarts."""
        while not self._stopping:
            await asyncio.sleep(POLL_INTERVAL_S)
            dead = self._dead_procs()
            if dead and not self._stopping:
                logger.warning("engine process(es) died %s; restarting the group", dead)
                await self._restart()

    async def _restart(self) -> None:
        self.num_restarts += 1
        if self.num_restarts > self.max_restarts:
            raise EngineDeadError(f"the engine died {self.num_restarts} times; giving up")
        self._kill_group()
        self.generation += 1
        ready = self._expect_generation(self.generation)
        self._spawn_group()
        while not ready.is_set():
            if self._dead_procs():
                return await self._restart()
            await asyncio.sleep(POLL_INTERVAL_S)
        # The new engine has attached to the requests ring: recompute every live request.
        for msg in self._resubmit():
            await self.requests.send_async(msg)
        logger.warning("generation %d ready; resubmitted in-flight requests", self.generation)

    def _kill_group(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        for p in self._procs:
            p.wait()

    def begin_stop(self) -> None:
        """The group is about to exit on purpose (Shutdown): stop restarting it."""
        self._stopping = True

    async def wait_engine_stopped(self) -> None:
        """Wait until the engine process exits (after a Shutdown drained it)."""
        while self._procs and self._procs[-1].poll() is None:
            await asyncio.sleep(POLL_INTERVAL_S / 2)

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Let the group exit (it was sent Shutdown), kill what remains, free the rings."""
        self._stopping = True
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self._procs and any(p.poll() is None for p in self._procs):
            if asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(POLL_INTERVAL_S / 2)
        self._kill_group()
        self.requests.close()
        self.outputs.close()
        for seg in self._segments:
            seg.close()  # the owner's close unlinks the segment and its semaphores
        self._segments = []


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
