"""Supervisor: starts, watches and restarts the engine and executor processes (DESIGN.md §8).

It lives in the frontend process and owns the ring segments (the four of DESIGN.md §1,
and a requests and an outputs ring per extra API server process; created 0600 under a
random run id, unlinked on exit; stale ones of crashed runs removed at start). The
engine process and the executor processes (one per tensor-parallel rank of each
pipeline stage) form one group: when any of them dies, the whole group is restarted, and every request in
flight is recomputed from its prompt plus the tokens already delivered, so callers see
a delay, not an error, and no token twice.

Restart handshake (NOTE: the order matters, see DESIGN.md §8):
1. close the requests gate: frontend sends wait, so nothing is written to a ring
   whose reader is dead or being claimed;
2. SIGKILL the whole group and wait for every process;
3. reset the reader slots of "steps" and "results" to RESERVED at their write cursors
   (both ends were in the group), and mark the engine's slot of "requests" DEAD: the
   new engine starts reading requests at the write cursor, since every live request
   is resubmitted in step 5;
4. spawn the new group; the executor's one-shot ExecutorReady waits in "results" for
   the engine however late the engine attaches (`RingSegment.reset_reader`);
5. on the new generation's ready message, resubmit every live request, then open the
   gate (a NewRequest that waited there and was resubmitted is not sent twice).

Other API server processes (`--api-server-count` > 1) have no gate: each resubmits its
own live requests when its outputs ring brings the new generation's ready message
(`DetokenizerActor.on_new_generation`). What one of them sent after step 3 reaches the
new engine as well; the engine keeps one copy of a request id it holds
(`EngineCore.handle`), and what it sent before step 3 is dropped with the old reader.

Every wait has a limit (`SupervisorLimits`, environment variables): a group that is not
ready in time is killed and restarted; `max_restarts` failures in a row make the
engine dead (EngineDeadError), and the server then exits non-zero.

Step watchdog: while requests are unfinished, the write cursors of "steps" and
"results" must move. No movement for `stall_unhealthy_s` makes `stalled_s` report it
(the engine client's health check fails, /health 503); past `execute_model_timeout_s`
the group is killed and restarted (a SIGSTOPped or hung executor or engine).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
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
from flowengine.shm.segment import CLOSED_W, WRITE_CURSOR_W

# flowengine/executor/ray_executor.py's LOCAL_PIDS_ENV (that module imports Ray lazily,
# but not here: the supervisor must not import it without the Ray backend).
RAY_LOCAL_PIDS_ENV = "FLOWENGINE_RAY_LOCAL_PIDS_FILE"

logger = logging.getLogger(__name__)

# Ring sizes: a step plan carries new requests in full (a 100k-token prompt is ~300 KB
# of msgpack), so "steps" and "requests" get the most room.
RING_BYTES = {"requests": 16 << 20, "outputs": 16 << 20, "steps": 32 << 20, "results": 8 << 20}
POLL_INTERVAL_S = 0.1
# A group that ran this long after its ready message ends a series of failed restarts.
GROUP_SURVIVED_S = 60.0


def _env_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} must be a number of seconds") from None
    if not value > 0:
        raise ValueError(f"{name}={raw!r} must be > 0 seconds")
    return value


@dataclass(frozen=True)
class SupervisorLimits:
    """Time limits of the process group, in seconds (docs/serving.md lists them).

    ready_timeout_s: start-up or restart of the group until its ready message (loads
        the weights): FLOWENGINE_ENGINE_READY_TIMEOUT_S, default 600 (vLLM's
        VLLM_ENGINE_READY_TIMEOUT_S).
    stall_unhealthy_s: no engine step while requests are unfinished for this long
        makes the health check fail: FLOWENGINE_STEP_STALL_UNHEALTHY_S, default 10.
    execute_model_timeout_s: ... for this long restarts the group:
        FLOWENGINE_EXECUTE_MODEL_TIMEOUT_S, default 300 (as vLLM's
        VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS).
    Raises ValueError for a value that is not a positive number.
    """

    ready_timeout_s: float = 600.0
    stall_unhealthy_s: float = 10.0
    execute_model_timeout_s: float = 300.0

    @classmethod
    def from_env(cls) -> SupervisorLimits:
        d = cls()
        return cls(
            ready_timeout_s=_env_seconds("FLOWENGINE_ENGINE_READY_TIMEOUT_S", d.ready_timeout_s),
            stall_unhealthy_s=_env_seconds("FLOWENGINE_STEP_STALL_UNHEALTHY_S",
                                           d.stall_unhealthy_s),
            execute_model_timeout_s=_env_seconds("FLOWENGINE_EXECUTE_MODEL_TIMEOUT_S",
                                                 d.execute_model_timeout_s),
        )


class RequestsGate:
    """The frontend's end of the "requests" ring: sends wait while the group restarts.

    Same sending interface as `Channel` (`send_async`, `close`). A `NewRequest` that
    waited through a restart and was resubmitted meanwhile is dropped, not sent twice.
    """

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self._open = asyncio.Event()
        self._open.set()
        self._resubmitted: set[str] = set()

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    def close_gate(self) -> None:
        self._open.clear()

    def open_gate(self, resubmitted: set[str]) -> None:
        self._resubmitted = resubmitted
        self._open.set()

    async def send_async(self, msg: Any) -> None:
        if not self._open.is_set():
            await self._open.wait()
            if isinstance(msg, NewRequest) and msg.request_id in self._resubmitted:
                return
        await self.channel.send_async(msg)

    def close(self) -> None:
        self.channel.close()


class Supervisor:
    """Owns the rings and the engine/executor process group.

    Args:
        resolved: the engine's resolved configuration (`flowengine.engine.builder`).
        expect_generation: called with a new generation number before a restarted
            group starts; returns an event set when that generation's ready message
            reaches the frontend (the Detokenizer actor's `expect_generation`).
        resubmit: returns the `NewRequest`s that recompute every live request.
        has_work: True while some request is unfinished (the step watchdog only
            counts time while there is work).
        max_restarts: restarts in a row allowed before the engine is declared dead
            (a restart whose group completes a step, or runs GROUP_SURVIVED_S, ends
            the row).
        limits: time limits (default: from the environment, `SupervisorLimits`).
        dp_rank: the data-parallel replica this group serves (its executors drive
            GPUs dp_rank * tensor_parallel_size * pipeline_parallel_size + rank); 0
            without data parallelism.
        num_api_servers: frontend processes with their own requests and outputs rings
            (`flowengine serve --api-server-count`); this frontend is the first, the
            others attach to `rings.client_requests[i - 1]` / `client_outputs[i - 1]`.
    """

    def __init__(
        self,
        resolved: Any,
        expect_generation: Callable[[int], Any],
        resubmit: Callable[[], list[NewRequest]],
        *,
        has_work: Callable[[], bool] = lambda: False,
        max_restarts: int = 20,
        limits: SupervisorLimits | None = None,
        dp_rank: int = 0,
        num_api_servers: int = 1,
    ) -> None:
        if num_api_servers < 1:
            raise ValueError(f"num_api_servers must be >= 1, got {num_api_servers}")
        self.dp_rank = dp_rank
        self.num_api_servers = num_api_servers
        self.resolved = resolved
        self._expect_generation = expect_generation
        self._resubmit = resubmit
        self._has_work = has_work
        self.max_restarts = max_restarts
        self.limits = limits or SupervisorLimits.from_env()
        self.num_restarts = 0  # since start
        self._failed_restarts = 0  # in a row, reset by a step of a new group
        self.restart_durations_s: list[float] = []
        self.generation = 0
        self._procs: list[subprocess.Popen] = []
        self._segments: dict[str, Any] = {}
        self._stopping = False
        self._restarting = False
        self._progress_key: tuple[int, int] = (0, 0)
        self._progress_t = time.monotonic()
        self._ready_t = time.monotonic()

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> EngineOutputs:
        """Create the rings, start the group and wait until it is ready; returns the
        ready message (its stats carry the KV cache size).

        Raises EngineDeadError when a process exits during start-up or the group is not
        ready within `limits.ready_timeout_s` (the group is killed, the rings freed).
        """
        cleanup_stale()
        self.run_id = new_run_id()
        num_ranks = self.num_executor_ranks
        self._segments = {
            "requests": create_ring("requests", RING_BYTES["requests"], run_id=self.run_id),
            "outputs": create_ring("outputs", RING_BYTES["outputs"], run_id=self.run_id),
            "steps": create_broadcast_ring("steps", num_ranks, RING_BYTES["steps"], run_id=self.run_id),
            "results": create_ring("results", RING_BYTES["results"], run_id=self.run_id),
        }
        for i in range(1, self.num_api_servers):
            for kind in ("requests", "outputs"):
                self._segments[f"{kind}{i}"] = create_ring(
                    f"{kind}{i}", RING_BYTES[kind], run_id=self.run_id)
        self.rings = RingNames(
            **{k: self._segments[k].name for k in ("requests", "outputs", "steps", "results")},
            client_requests=tuple(self._segments[f"requests{i}"].name
                                  for i in range(1, self.num_api_servers)),
            client_outputs=tuple(self._segments[f"outputs{i}"].name
                                 for i in range(1, self.num_api_servers)),
        )
        self.requests = RequestsGate(
            Channel(RingWriter.attach(self.rings.requests), RequestsMsg))
        self.outputs = Channel(RingReader.attach(self.rings.outputs), EngineOutputs)
        try:
            self._spawn_group()
            first = await self._wait_ready_message()
            if first.generation != 0:
                raise EngineDeadError(f"unexpected engine generation {first.generation} at start")
        except BaseException:
            await self.stop(timeout_s=0.0)
            raise
        self._mark_progress()
        return first

    async def _wait_ready_message(self) -> EngineOutputs:
        deadline = time.monotonic() + self.limits.ready_timeout_s
        recv = asyncio.ensure_future(self.outputs.recv_async())
        try:
            while not recv.done():
                dead = self._dead_procs()
                if dead:
                    raise EngineDeadError(
                        f"engine processes exited during start-up (pid, exit code): {dead}; "
                        "their log lines above say why")
                if time.monotonic() > deadline:
                    raise EngineDeadError(self._not_ready_message())
                await asyncio.wait([recv], timeout=POLL_INTERVAL_S)
            return recv.result()
        finally:
            recv.cancel()

    def _not_ready_message(self) -> str:
        return (f"the engine group (generation {self.generation}) was not ready within "
                f"{self.limits.ready_timeout_s:g} s; raise FLOWENGINE_ENGINE_READY_TIMEOUT_S "
                "if loading the model takes longer")

    @property
    def num_executor_ranks(self) -> int:
        """Executor processes of the group: tensor_parallel_size per pipeline stage."""
        args = self.resolved.args
        return args.tensor_parallel_size * args.pipeline_parallel_size

    def _spawn_group(self) -> None:
        num_ranks = self.num_executor_ranks
        roles = [("executor", rank) for rank in range(num_ranks)] + [("engine", 0)]
        if self.resolved.args.distributed_executor_backend == "ray":
            # One local driver places every rank as a Ray actor and exits when one
            # fails (flowengine/executor/ray_executor.py): the group restarts as usual.
            roles = [("ray_driver", 0), ("engine", 0)]
        env = dict(os.environ)
        python = worker_python(env)
        if roles[0][0] == "ray_driver":
            env[RAY_LOCAL_PIDS_ENV] = self._ray_pids_file
        # A fresh rendezvous per group: a restarted group must not meet the old one.
        dist_init_method = f"tcp://127.0.0.1:{free_port()}" if num_ranks > 1 else ""
        # (the Ray driver picks its own rendezvous, on rank 0's node)
        self._procs = []
        for role, rank in roles:
            cfg = ProcConfig(role, self.resolved.args, self.rings, rank, self.generation,
                             dist_init_method, self.limits.ready_timeout_s, self.dp_rank)
            cmd = [*python, msgspec.json.encode(cfg).decode()]
            self._procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL))
        logger.info("%sgeneration %d: started pids %s",
                    f"data-parallel replica {self.dp_rank}: "
                    if self.resolved.args.data_parallel_size > 1 else "",
                    self.generation, [p.pid for p in self._procs])

    def _dead_procs(self) -> list[tuple[int, int]]:
        return [(p.pid, p.returncode) for p in self._procs if p.poll() is not None]

    @property
    def pids(self) -> dict[str, list[int]]:
        """{"engine": [pid], "executor": [pid per rank]} of the current group (global
        ranks: the stage is rank // tensor_parallel_size; the Ray backend: [the
        driver's pid])."""
        return {"executor": [p.pid for p in self._procs[:-1]], "engine": [self._procs[-1].pid]}

    # ------------------------------------------------------------------ watching
    async def run(self) -> None:
        """Watch the group; restart it when a process dies or the step watchdog fires.
        Raises EngineDeadError after `max_restarts` failed restarts in a row."""
        while not self._stopping:
            await asyncio.sleep(POLL_INTERVAL_S)
            if self._stopping:
                break
            dead = self._dead_procs()
            if dead:
                logger.warning("engine process(es) died (pid, exit code) %s; restarting the "
                               "group", dead)
                await self._restart()
                continue
            stalled_s = self.stalled_s  # also observes progress
            if stalled_s > self.limits.execute_model_timeout_s:
                logger.error(
                    "no engine step for %.0f s while requests wait (limit %g s, "
                    "FLOWENGINE_EXECUTE_MODEL_TIMEOUT_S); restarting the group",
                    stalled_s, self.limits.execute_model_timeout_s)
                await self._restart()

    @property
    def stalled_s(self) -> float:
        """Seconds without an engine step while requests are unfinished (0 when idle
        or stepping). Counts a restart in progress too: the engine cannot serve then."""
        self._observe_progress()
        if not self._restarting and not self._has_work():
            self._progress_t = time.monotonic()
            return 0.0
        return time.monotonic() - self._progress_t

    def unhealthy_reason(self) -> str | None:
        """Why the engine cannot serve now (stalled past `stall_unhealthy_s`), or None."""
        stalled_s = self.stalled_s
        if stalled_s <= self.limits.stall_unhealthy_s:
            return None
        what = "restarting" if self._restarting else "no engine step"
        return (f"{what} for {stalled_s:.1f} s while requests wait (limit "
                f"{self.limits.stall_unhealthy_s:g} s, FLOWENGINE_STEP_STALL_UNHEALTHY_S)")

    def _observe_progress(self) -> None:
        # The write cursors of "steps" (the engine planned a step) and "results" (the
        # executor finished one) are monotonic byte counts: any change is progress.
        # NOTE: read from our own (owner) mappings; no process of the group can stall
        # them, and a SIGSTOPped engine or executor stops them.
        segs = self._segments
        if not segs or self._restarting:
            return
        key = (segs["steps"].words[WRITE_CURSOR_W], segs["results"].words[WRITE_CURSOR_W])
        if key != self._progress_key:
            if key[1] != self._progress_key[1]:
                self._failed_restarts = 0  # the new group completed a step
            self._progress_key = key
            self._progress_t = time.monotonic()
        if time.monotonic() - self._ready_t > GROUP_SURVIVED_S:
            self._failed_restarts = 0  # no crash loop: the group has run a while

    def _mark_progress(self) -> None:
        self._progress_t = time.monotonic()
        segs = self._segments
        self._progress_key = (segs["steps"].words[WRITE_CURSOR_W],
                              segs["results"].words[WRITE_CURSOR_W])

    async def _restart(self) -> None:
        t0 = time.monotonic()
        self._restarting = True
        self.requests.close_gate()
        try:
            while True:
                self.num_restarts += 1
                self._failed_restarts += 1
                if self._failed_restarts > self.max_restarts:
                    raise EngineDeadError(
                        f"the engine group failed {self._failed_restarts - 1} restarts in a "
                        "row; giving up")
                self._kill_group()
                self._reset_rings()
                self.generation += 1
                ready = self._expect_generation(self.generation)
                self._spawn_group()
                error = await self._wait_restarted(ready)
                if error is None:
                    break
                logger.error("generation %d: %s; restarting the group again",
                             self.generation, error)
            # The new engine has attached to the requests ring: recompute every live
            # request, then let the frontend's waiting sends through.
            resubmitted = self._resubmit()
            for msg in resubmitted:
                await self.requests.channel.send_async(msg)
            self.requests.open_gate({m.request_id for m in resubmitted})
        finally:
            self._restarting = False
            if not self.requests.is_open:
                # The restart was cancelled (shutdown) or gave up (EngineDeadError):
                # never leave a sender, e.g. a shielded abort, waiting forever.
                self.requests.open_gate(set())
            if self._segments:
                self._mark_progress()
        self._ready_t = time.monotonic()
        self.restart_durations_s.append(time.monotonic() - t0)
        logger.warning("generation %d ready after %.1f s; resubmitted in-flight requests",
                       self.generation, self.restart_durations_s[-1])

    async def _wait_restarted(self, ready: Any) -> str | None:
        """Wait for the new group's ready message; None when ready, else what failed."""
        deadline = time.monotonic() + self.limits.ready_timeout_s
        while not ready.is_set():
            dead = self._dead_procs()
            if dead:
                return f"process(es) exited during the restart (pid, exit code) {dead}"
            if time.monotonic() > deadline:
                return self._not_ready_message()
            await asyncio.sleep(POLL_INTERVAL_S)
        return None

    def _reset_rings(self) -> None:
        """Step 3 of the handshake (module docstring): every process of the group is
        gone, so their ring ends can be reset without racing anyone."""
        steps, results = self._segments["steps"], self._segments["results"]
        for i in range(steps.num_readers):
            steps.reset_reader(i)
        results.reset_reader(0)
        for segment in (steps, results):
            # A writer of the old group that closed its end (RingWriter.close) set
            # `closed`: a new reader attaching before the new writer claims the ring
            # would read the stream as ended.
            segment.words[CLOSED_W] = 0
        for name, segment in self._segments.items():
            if name.startswith("requests"):  # "requests{i}": the other API servers' too
                segment.mark_reader_dead(0)

    def _kill_group(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        for p in self._procs:
            p.wait()
        if self.resolved.args.distributed_executor_backend == "ray":
            from flowengine.executor.ray_executor import kill_local_ranks

            # The driver's actors on this host read the rings: gone before any reset.
            kill_local_ranks(self._ray_pids_file)
            # Any process still holding a ring slot escaped both (issue #18): kill it,
            # so _reset_rings cannot find a slot "held by live pid".
            from flowengine.executor.ray_executor import kill_slot_holders

            if self._segments:
                kill_slot_holders([self._segments["steps"], self._segments["results"]])

    @property
    def _ray_pids_file(self) -> str:
        return os.path.join(tempfile.gettempdir(), f"fe-{self.run_id}-ray-local-pids")

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
        if self._segments:
            self.requests.close()
            self.outputs.close()
        for seg in self._segments.values():
            seg.close()  # the owner's close unlinks the segment and its semaphores
        self._segments = {}


def worker_python(env: dict[str, str], module: str = "flowengine.actors.procs") -> list[str]:
    """The command (without its ProcConfig argument) that starts an engine or executor
    process (`module`: another entry point, e.g. an API server process) importing the
    same `flowengine` as this process; may prepend to env["PYTHONPATH"].

    `python -m` would put the working directory first on the child's sys.path, and a
    clone's root holds the source tree, without the compiled extensions, beside a
    `pip install .` that has them: the children then died at start-up
    (`cannot import name '_ring'`). So the child runs with `-P` (Python >= 3.11: no
    working directory on sys.path), and only where this process imported flowengine from
    the working directory itself (an editable install, or a source tree run from its
    root) does that directory go on PYTHONPATH, as before.
    """
    import flowengine

    root = os.path.dirname(os.path.dirname(os.path.abspath(flowengine.__file__)))
    if os.path.abspath(os.getcwd()) == root:
        rest = env.get("PYTHONPATH")
        env["PYTHONPATH"] = root if not rest else os.pathsep.join([root, rest])
    return [sys.executable, "-P", "-m", module]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
