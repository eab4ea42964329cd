"""API server processes 1..N-1 of `flowengine serve --api-server-count N` (vLLM's flag).

One frontend process serializes everything a streamed token costs on the host: the
HTTP and SSE framing (Hypercorn), detokenizing, tokenizing new prompts. On a GPU that
runs a small model fast, that one core is the ceiling (docs/benchmarks.md, issue 12:
~25 us of server CPU per streamed token). With N > 1, process 0 (the one started)
loads the engine as usual, binds the listening socket, and starts N-1 more processes
that each take connections from that same socket and run the whole frontend
(`AsyncEngine` attached to the engine over their own requests and outputs rings,
`APIServer` on Hypercorn), so the per-token frontend work spreads over N cores while
one engine schedules every request (flowengine/engine/client_router.py routes each
step's outputs to the process that owns the request).

    process 0: supervisor, engine + executor processes, HTTP on the socket
    process i: HTTP on the same socket (inherited fd), rings "requests{i}"/"outputs{i}"

Each process runs `python -P -m flowengine.entrypoints.openai.api_servers '<spec>'`
(msgspec JSON: the same `flowengine serve` flags, its rings, the socket's fd, the queue
limit process 0 settled). Process 0 restarts one that dies (its connections are lost;
the engine aborts its requests on the new process's `ClientStart`); one that exits
within FAST_EXIT_S of its start MAX_FAST_EXITS times in a row is not restarted again.
On SIGTERM process 0 passes SIGTERM on; each process drains its own requests.

/metrics gives the same totals in every process (engine/frontend_stats.py: each
process publishes its request counters, the others add them). Per process, not shared:
the `--max-queue-len` admission limit and the Responses API's stored responses
(`previous_response_id` finds a response only in the process that made it). gRPC
(`--grpc-port`) is served by process 0 only.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import msgspec

from flowengine.actors.procs import APIServerAttach

logger = logging.getLogger("flowengine.entrypoints.openai.api_servers")  # also as __main__

FAST_EXIT_S = 30.0
MAX_FAST_EXITS = 5
POLL_INTERVAL_S = 0.5
READY_TIMEOUT_S = 600.0  # for processes 1..N-1 to load their tokenizers and serve


class APIServerSpec(msgspec.Struct, frozen=True):
    """The command-line argument of API server process `attach.index`."""

    attach: APIServerAttach
    argv: list[str]  # the `flowengine serve` flags of process 0
    fd: int  # the listening socket, inherited
    max_queue_len: int
    ready_fd: int = -1  # a pipe's write end: one byte once Hypercorn serves, then closed


class APIServerProcs:
    """Starts, restarts and stops API server processes 1..count-1 (in process 0).

    Args:
        engine: process 0's started `AsyncEngine` (`api_server_attach(i)`).
        argv: the `flowengine serve` flags.
        sock: the listening socket; its fd is duplicated here, so process 0 may hand
            the socket itself to Hypercorn.
        max_queue_len: the admission limit each process applies.
        count: API server processes in all, process 0 included (>= 2).
    """

    def __init__(self, engine: Any, argv: list[str], sock: socket.socket, max_queue_len: int,
                 count: int) -> None:
        if count < 2:
            raise ValueError(f"count must be >= 2, got {count}")
        self.engine = engine
        self.argv = list(argv)
        self.max_queue_len = max_queue_len
        self.count = count
        self._fd = os.dup(sock.fileno())
        self._procs: dict[int, subprocess.Popen] = {}
        self._started_at: dict[int, float] = {}
        self._fast_exits: dict[int, int] = dict.fromkeys(range(1, count), 0)
        self._terminated: set[int] = set()  # pids sent SIGTERM
        self._given_up: list[Any] = []  # requests-ring writers of processes not restarted
        self._stopping = False
        self._watch: asyncio.Task[None] | None = None
        self._ready: dict[int, asyncio.Future[bool]] = {}
        self.num_restarts = 0

    @property
    def pids(self) -> dict[int, int]:
        """Process index -> pid of the running ones."""
        return {i: p.pid for i, p in self._procs.items() if p.poll() is None}

    async def start(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Start processes 1..count-1, wait until each serves, then watch them (restart
        those that die). Raises RuntimeError (every process stopped) when one exits
        before it serves or is not serving within `timeout_s`."""
        for index in range(1, self.count):
            self._spawn(index)
        try:
            async with asyncio.timeout(timeout_s):
                for index, ready in list(self._ready.items()):
                    if not await ready:
                        proc = self._procs[index]
                        raise RuntimeError(
                            f"API server {index} (pid {proc.pid}) exited before serving "
                            f"(code {proc.wait()}); its log lines above say why")
        except BaseException as err:
            await self.stop(0.0)
            if isinstance(err, TimeoutError):
                raise RuntimeError(f"API servers not serving within {timeout_s:g} s") from None
            raise
        self._watch = asyncio.get_running_loop().create_task(self._run())

    def _spawn(self, index: int) -> None:
        from flowengine.actors.supervisor import worker_python

        read_fd, write_fd = os.pipe()
        spec = APIServerSpec(self.engine.api_server_attach(index), self.argv, self._fd,
                             self.max_queue_len, write_fd)
        env = dict(os.environ)
        cmd = [*worker_python(env, "flowengine.entrypoints.openai.api_servers"),
               msgspec.json.encode(spec).decode()]
        try:
            self._procs[index] = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL,
                                                  pass_fds=(self._fd, write_fd))
        finally:
            os.close(write_fd)
        self._started_at[index] = time.monotonic()
        self._ready[index] = self._watch_ready(index, read_fd)
        logger.info("API server %d: started pid %d", index, self._procs[index].pid)

    def _watch_ready(self, index: int, read_fd: int) -> asyncio.Future[bool]:
        """A future set to True when process `index` writes its byte, False when the
        pipe closes without one (it exited first)."""
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[bool] = loop.create_future()

        def on_readable() -> None:
            loop.remove_reader(read_fd)
            data = os.read(read_fd, 1)
            os.close(read_fd)
            if data:
                logger.info("API server %d: serving", index)
            if not ready.done():
                ready.set_result(bool(data))

        loop.add_reader(read_fd, on_readable)
        return ready

    async def _run(self) -> None:
        while not self._stopping:
            await asyncio.sleep(POLL_INTERVAL_S)
            for index, proc in list(self._procs.items()):
                if self._stopping or proc.poll() is None:
                    continue
                lived_s = time.monotonic() - self._started_at[index]
                self._fast_exits[index] = (self._fast_exits[index] + 1
                                           if lived_s < FAST_EXIT_S else 0)
                if self._fast_exits[index] >= MAX_FAST_EXITS:
                    logger.error("API server %d exited %d times within %.0f s of starting "
                                 "(last exit code %s); not restarting it", index,
                                 self._fast_exits[index], FAST_EXIT_S, proc.returncode)
                    del self._procs[index]
                    await self._abort_left_by(index)
                    continue
                logger.warning("API server %d (pid %d) exited with code %s; restarting it",
                               index, proc.pid, proc.returncode)
                self.num_restarts += 1
                self._spawn(index)

    async def _abort_left_by(self, index: int) -> None:
        """What a process that is not restarted left in the engine is aborted, as its
        successor's ClientStart would: this process takes over its requests ring's
        writing end (kept open: a closed ring would end the engine's inbox)."""
        from flowengine.messages import ClientStart, RequestsMsg
        from flowengine.shm import Channel, RingWriter

        try:
            writer = Channel(RingWriter.attach(self.engine.api_server_attach(index).requests),
                             RequestsMsg)
            await writer.send_async(ClientStart())
            self._given_up.append(writer)
        except Exception as err:  # noqa: BLE001 - its requests then run to their end
            logger.warning("could not abort API server %d's requests: %r", index, err)

    def terminate(self) -> None:
        """SIGTERM to each running process, once (they drain); no more restarts."""
        self._stopping = True
        for proc in self._procs.values():
            if proc.poll() is None and proc.pid not in self._terminated:
                self._terminated.add(proc.pid)
                proc.send_signal(signal.SIGTERM)

    async def stop(self, timeout_s: float) -> None:
        """terminate(), wait up to `timeout_s` for every process, then SIGKILL."""
        self.terminate()
        if self._watch is not None:
            self._watch.cancel()
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in self._procs.values()):
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        for index, proc in self._procs.items():
            if proc.poll() is None:
                logger.warning("API server %d did not stop within %.0f s; killing it",
                               index, timeout_s)
                proc.kill()
                proc.wait()
        os.close(self._fd)


async def serve_attached(spec: APIServerSpec, ns: Any) -> int:
    """Run API server `spec.attach.index` (flags parsed into `ns`) until SIGTERM (or
    process 0 goes away)."""
    from flowengine.entrypoints.async_engine import AsyncEngine
    from flowengine.entrypoints.openai.server import (
        ENGINE_SHUTDOWN_TIMEOUT_S,
        build_api_server,
        engine_args_from,
        options_from,
    )

    index = spec.attach.index
    options = options_from(ns)
    engine_args = engine_args_from(ns)
    engine = AsyncEngine.from_engine_args(engine_args, attach=spec.attach)
    await engine.start()

    def serving() -> None:
        logger.info("API server %d serving", index)
        if spec.ready_fd >= 0:
            try:
                os.write(spec.ready_fd, b"1")
            except OSError:  # process 0 stopped waiting
                pass
            os.close(spec.ready_fd)

    server = build_api_server(engine, engine_args, options, spec.max_queue_len, serving)
    loop = asyncio.get_running_loop()
    stopping = False

    def on_sigterm() -> None:
        # Process 0 passes SIGTERM on, and systemd may send it to every process of
        # the unit as well: one drain, however many signals.
        nonlocal stopping
        if not stopping:
            stopping = True
            server.begin_shutdown()

    loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    try:
        await server.serve(socket.socket(fileno=spec.fd))
    finally:
        stopping = True  # a later SIGTERM must not cut the engine client's shutdown
        await engine.shutdown(drain_timeout_s=ENGINE_SHUTDOWN_TIMEOUT_S)
        loop.remove_signal_handler(signal.SIGTERM)
    return 0


def main(argv: list[str] | None = None) -> int:
    from flowengine.actors.procs import exit_with_parent, new_event_loop_factory
    from flowengine.entrypoints.openai.server import make_parser

    argv = sys.argv[1:] if argv is None else argv
    spec = msgspec.json.decode(argv[0], type=APIServerSpec)
    ns = make_parser().parse_args(spec.argv)
    logging.basicConfig(
        level=ns.log_level.upper(),
        format=f"%(asctime)s api_server{spec.attach.index} %(levelname)s %(name)s: %(message)s",
    )
    if ns.disable_log_requests:
        logging.getLogger("flowengine.entrypoints.openai.requests").setLevel(logging.WARNING)
    # Process 0 owns shutdown: Ctrl-C reaches the whole process group, and process 0
    # answers it by passing SIGTERM on.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent()
    with asyncio.Runner(loop_factory=new_event_loop_factory()) as runner:
        return runner.run(serve_attached(spec, ns))


if __name__ == "__main__":
    raise SystemExit(main())
