"""The Ray backend (`--distributed-executor-backend ray`, vLLM's flag and meaning).

The executor ranks (tensor-parallel ranks of each pipeline stage) run as Ray actors on
a cluster started with `ray start --head` and `ray start --address=HEAD:6379`; the
engine process and the frontend stay on this host. The supervisor starts one local
*driver* process in place of the executor processes (`driver_main`, role
"ray_driver"); it joins the cluster (`ray.init(address="auto")` or RAY_ADDRESS),
places the ranks with one placement group and runs in every actor the same
`executor_main` our executor processes run.

Placement: one bundle per pipeline stage of {"CPU": tensor_parallel_size} (plus the
GPUs on CUDA): the tensor-parallel ranks of a stage share a bundle, so they are on one
node; the stages follow FLOWENGINE_RAY_PLACEMENT_STRATEGY (vLLM's default "PACK";
"STRICT_SPREAD" puts every stage on its own node).

Transports:
- a rank on this host (its Ray node has the driver's IP) attaches to the shared-memory
  rings itself, as an executor process does;
- a rank on another node gets its plans and sends its results through a TCP channel
  of msgspec bytes to the driver, which relays them to and from the rings unchanged
  (`relay_rank`): frames of a 4-byte big-endian length and the msgpack record; the
  actor opens it with a 32-byte secret (compared in constant time) so no other host
  can read plans or write results;
- hidden states between stages and the tensor-parallel collectives go through
  `torch.distributed` (gloo on the CPU, NCCL on GPUs), its rendezvous on rank 0's node.

Ray pickles the arguments of actor calls: every call here passes only msgspec-encoded
bytes or plain ints/strings, never prompts, outputs or engine objects.

Failure: the driver awaits every actor's `run`; an actor that dies (kill -9 of its
worker, its node lost) makes the driver exit non-zero, and the supervisor restarts the
group like a dead executor process (Ray kills the old actors with their owner, the
driver). A placement group that cannot be placed within
FLOWENGINE_RAY_PLACEMENT_TIMEOUT_S (a node that never returns) makes the driver exit
with an error naming the bundles and the cluster's resources.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import secrets
import socket
import struct
import sys
import time
from typing import Any

import msgspec

from flowengine.actors.procs import ProcConfig
from flowengine.net import host_port

logger = logging.getLogger(__name__)

PLACEMENT_STRATEGY_ENV = "FLOWENGINE_RAY_PLACEMENT_STRATEGY"
PLACEMENT_TIMEOUT_ENV = "FLOWENGINE_RAY_PLACEMENT_TIMEOUT_S"
# The supervisor names a file here; the driver lists in it the pids of its actors on
# this host (they attach to the rings), which the supervisor kills with the group:
# Ray ends a dead driver's actors only some seconds later, and the new group's ranks
# must not meet them on the rings.
LOCAL_PIDS_ENV = "FLOWENGINE_RAY_LOCAL_PIDS_FILE"
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
# Environment the actors need from ours (Ray workers inherit the raylet's, not ours).
FORWARDED_ENV_PREFIXES = ("FLOWENGINE_", "HF_", "TRANSFORMERS_", "OMP_", "TOKENIZERS_")
_LEN = struct.Struct(">I")
TOKEN_BYTES = 32
MAX_FRAME_BYTES = 64 << 20  # above the steps ring's 32 MiB: no record is larger


class RankLaunch(msgspec.Struct, frozen=True):
    """One actor's start-up configuration (its `run` argument, msgspec JSON bytes).

    relay: "IP:PORT" of the driver's TCP channel for a rank on another node, "" for a
    rank on the driver's host (it attaches to the rings). token: the relay's secret
    (hex). env: FLOWENGINE_* and similar variables of the frontend."""

    proc: ProcConfig
    relay: str = ""
    token: str = ""
    env: dict[str, str] = {}


# ---------------------------------------------------------------- the TCP channel
async def read_frame(reader: asyncio.StreamReader) -> bytes:
    """One length-prefixed frame. Raises asyncio.IncompleteReadError at EOF and
    ValueError for a frame over MAX_FRAME_BYTES."""
    (length,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    if length > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {length} bytes exceeds {MAX_FRAME_BYTES}")
    return await reader.readexactly(length)


def write_frame(writer: asyncio.StreamWriter, payload: bytes | bytearray | memoryview) -> None:
    writer.write(_LEN.pack(len(payload)))
    writer.write(payload)


class TcpChannel:
    """The receiving or sending end of a message stream over one TCP connection, with
    the async half of `MessageChannel` (what ExecutorActor uses): messages of
    `msg_type` as msgpack frames. Raises ChannelClosedError when the peer is gone."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 msg_type: Any) -> None:
        self._reader, self._writer = reader, writer
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(msg_type)

    async def recv_async(self) -> Any:
        from flowengine.shm import ChannelClosedError

        try:
            return self._decoder.decode(await read_frame(self._reader))
        except (asyncio.IncompleteReadError, ConnectionError):
            raise ChannelClosedError("the driver's TCP channel closed") from None

    async def send_async(self, msg: Any) -> None:
        from flowengine.shm import ChannelClosedError

        try:
            write_frame(self._writer, self._encoder.encode(msg))
            await self._writer.drain()
        except ConnectionError:
            raise ChannelClosedError("the driver's TCP channel closed") from None

    def close(self) -> None:
        self._writer.close()


# ---------------------------------------------------------------- the actor
def interface_of(ip: str) -> str | None:
    """The network interface holding IPv4 address `ip` (gloo must use the interface
    the other nodes reach, not the one the host name resolves to), or None."""
    import fcntl

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(sock.fileno(), siocgifaddr,
                                     struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on this interface
            if socket.inet_ntoa(packed[20:24]) == ip:
                return name
    return None


class RankWorker:
    """The body of one executor rank's Ray actor (wrapped by `ray.remote` in the
    driver, so importing this module needs no Ray)."""

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def where(self) -> tuple[str, int]:
        """(node IP, pid) of this actor's worker process."""
        return self.node_ip(), os.getpid()

    def free_port(self) -> int:
        """A TCP port free now on this node's address (the group's rendezvous)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((self.node_ip(), 0))
            return sock.getsockname()[1]

    def run(self, launch: bytes) -> int:
        """Run executor_main for the RankLaunch in `launch` (msgspec JSON) until its
        Shutdown; returns 0. Errors propagate (the driver sees the actor fail)."""
        from flowengine.actors.procs import new_event_loop_factory

        cfg = msgspec.json.decode(launch, type=RankLaunch)
        os.environ.update(cfg.env)
        logging.basicConfig(
            level=os.environ.get("FLOWENGINE_LOG_LEVEL", "WARNING"),
            format=f"%(asctime)s ray-executor{cfg.proc.rank} %(levelname)s %(name)s: "
                   "%(message)s")
        if "GLOO_SOCKET_IFNAME" not in os.environ:
            ifname = interface_of(self.node_ip())
            if ifname:
                os.environ["GLOO_SOCKET_IFNAME"] = ifname
        with asyncio.Runner(loop_factory=new_event_loop_factory()) as runner:
            runner.run(_run_rank(cfg))
        return 0


async def _run_rank(cfg: RankLaunch) -> None:
    from flowengine.actors.procs import executor_main
    from flowengine.messages import ResultsMsg, StepsMsg

    if not cfg.relay:
        await executor_main(cfg.proc)
        return
    host, _, port = cfg.relay.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    write_frame(writer, bytes.fromhex(cfg.token))
    await writer.drain()
    await executor_main(cfg.proc, steps=TcpChannel(reader, writer, StepsMsg),
                        results=TcpChannel(reader, writer, ResultsMsg))


# ---------------------------------------------------------------- the driver
async def relay_rank(server_sock: socket.socket, token: bytes, steps_name: str,
                     rank: int, results_name: str | None) -> None:
    """Serve one remote rank: accept its connection (checking `token`), then copy
    every record of the steps ring (reader slot `rank`) to it and, for the sampling
    rank (`results_name` given), every frame from it to the results ring, as bytes
    (the engine and the executor decode them with their types). Returns when the
    rank's connection or the steps ring closes."""
    from flowengine.shm import ChannelClosedError, RingReader, RingWriter

    accepted: asyncio.Future = asyncio.get_running_loop().create_future()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            hello = await asyncio.wait_for(read_frame(reader), 30.0)
        except (asyncio.IncompleteReadError, ValueError, TimeoutError, ConnectionError):
            writer.close()
            return
        if accepted.done() or not hmac.compare_digest(hello, token):
            logger.warning("rejected a connection to executor rank %d's channel", rank)
            writer.close()
            return
        accepted.set_result((reader, writer))

    server = await asyncio.start_server(on_connect, sock=server_sock)
    reader, writer = await accepted
    server.close()
    steps = RingReader.attach(steps_name, reader_index=rank)
    results = RingWriter.attach(results_name) if results_name else None

    async def downstream() -> None:
        try:
            while True:
                for record in await steps.recv_many_async():
                    write_frame(writer, record)
                await writer.drain()
        except ChannelClosedError:
            pass

    async def upstream() -> None:
        while True:
            try:
                frame = await read_frame(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            if results is None:
                raise RuntimeError(f"executor rank {rank} sent results; only the sampling "
                                   "rank may")
            await results.send_async(frame)

    tasks = [asyncio.ensure_future(downstream()), asyncio.ensure_future(upstream())]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        writer.close()
        steps.close()  # stops its waiter thread
        if results is not None:
            # Not close(): that marks the ring closed, and the next group's engine,
            # reading it, would die of "closed and drained" (issue #18, lost node).
            results.detach()


def placement_bundles(tp: int, pp: int, gpus: bool) -> list[dict[str, float]]:
    """One bundle per pipeline stage: its tensor-parallel ranks' CPUs (and GPUs)."""
    bundle: dict[str, float] = {"CPU": float(tp)}
    if gpus:
        bundle["GPU"] = float(tp)
    return [dict(bundle) for _ in range(pp)]


def placement_strategy() -> str:
    """FLOWENGINE_RAY_PLACEMENT_STRATEGY (default PACK); ValueError for other values."""
    strategy = os.environ.get(PLACEMENT_STRATEGY_ENV, "PACK")
    if strategy not in PLACEMENT_STRATEGIES:
        raise ValueError(f"{PLACEMENT_STRATEGY_ENV}={strategy!r}: expected one of "
                         f"{PLACEMENT_STRATEGIES}")
    return strategy


def forwarded_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)}


async def driver_main(cfg: ProcConfig) -> None:
    """Place the group's ranks as Ray actors, relay remote ranks' channels, and exit
    (non-zero, through an exception) as soon as any actor fails."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from flowengine.engine.builder import resolve

    args = cfg.engine_args
    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    num_ranks = tp * pp
    gpus = resolve(args).device.startswith("cuda")
    strategy = placement_strategy()
    timeout_s = float(os.environ.get(PLACEMENT_TIMEOUT_ENV, "60"))
    ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), logging_level=logging.WARNING,
             log_to_driver=True, configure_logging=False)
    driver_ip = ray.util.get_node_ip_address()
    bundles = placement_bundles(tp, pp, gpus)
    pg = placement_group(bundles, strategy=strategy)
    ready = pg.ready()
    done, _ = ray.wait([ready], timeout=timeout_s)
    if not done:
        raise RuntimeError(
            f"the Ray placement group of {pp} bundle(s) {bundles[0]} ({strategy}, "
            f"{PLACEMENT_STRATEGY_ENV}) was not placed within {timeout_s:g} s "
            f"({PLACEMENT_TIMEOUT_ENV}); the cluster has {ray.cluster_resources()} on "
            f"{len([n for n in ray.nodes() if n['Alive']])} live node(s): a node is missing")
    actor_cls = ray.remote(RankWorker)
    actors = [
        actor_cls.options(
            num_cpus=1, num_gpus=1 if gpus else 0, max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=rank // tp),
        ).remote()
        for rank in range(num_ranks)
    ]
    ips, pids = zip(*ray.get([a.where.remote() for a in actors], timeout=timeout_s),
                    strict=True)
    pids_file = os.environ.get(LOCAL_PIDS_ENV)
    if pids_file:
        fd = os.open(pids_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("".join(f"{pid}\n" for ip, pid in zip(ips, pids, strict=True)
                            if ip == driver_ip))
    init_method = ""
    if num_ranks > 1:
        port = ray.get(actors[0].free_port.remote(), timeout=timeout_s)
        init_method = f"tcp://{host_port(ips[0], port)}"
    sampling_rank = (pp - 1) * tp
    env = forwarded_env()
    relays, refs = [], []
    for rank, (actor, ip) in enumerate(zip(actors, ips, strict=True)):
        proc = msgspec.structs.replace(cfg, role="executor", rank=rank,
                                       dist_init_method=init_method)
        relay, token = "", ""
        if ip != driver_ip:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((driver_ip, 0))
            sock.listen(1)
            secret = secrets.token_bytes(TOKEN_BYTES)
            relay, token = f"{driver_ip}:{sock.getsockname()[1]}", secret.hex()
            relays.append(asyncio.ensure_future(relay_rank(
                sock, secret, cfg.rings.steps, rank,
                cfg.rings.results if rank == sampling_rank else None)))
        launch = msgspec.json.encode(RankLaunch(proc, relay, token, env))
        refs.append(actor.run.remote(launch))
    logger.warning("generation %d: executor ranks on Ray nodes %s (driver %s)",
                   cfg.generation, ips, driver_ip)
    runs = [asyncio.wrap_future(ref.future()) for ref in refs]
    pending = set(runs) | set(relays)
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for fut in done:
            if fut in runs and fut.exception() is not None:
                rank = runs.index(fut)
                raise RuntimeError(f"executor rank {rank} (Ray actor on {ips[rank]}) "
                                   f"failed: {fut.exception()}")
            fut.result()  # a relay's error ends the group too
    ray.util.remove_placement_group(pg)


def _is_ray_worker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except OSError:
        return False
    return cmdline.startswith(b"ray::") and state != b"Z"


def kill_local_ranks(pids_file: str, timeout_s: float = 10.0) -> list[int]:
    """SIGKILL the Ray worker processes listed in `pids_file` (the driver's actors on
    this host; a pid that is no Ray worker any more is left alone), wait up to
    `timeout_s` until they are gone, remove the file. Returns the pids killed; never
    raises."""
    try:
        with open(pids_file) as f:
            pids = [int(line) for line in f if line.strip()]
        os.unlink(pids_file)
    except (OSError, ValueError):
        return []
    killed = [pid for pid in pids if _is_ray_worker(pid)]
    for pid in killed:
        try:
            os.kill(pid, 9)
        except OSError:
            pass
    deadline = time.monotonic() + timeout_s
    while any(_is_ray_worker(pid) for pid in killed) and time.monotonic() < deadline:
        time.sleep(0.05)
    return killed


def kill_slot_holders(segments: list[Any], timeout_s: float = 10.0) -> list[int]:
    """SIGKILL every live process other than this one that still holds a reader slot
    of `segments` (RingSegments: the group's "steps" and "results"), wait up to
    `timeout_s` until each is gone. Returns the pids killed; never raises.

    The restart path calls it after `_kill_group` killed the group's own processes
    and the driver's local actors: any holder left is an old process that escaped
    them (a Ray worker the pids file did not list, e.g. one placed after the file was
    written or by a driver killed before it wrote it). `reset_reader` then finds the
    slots free instead of raising "held by live pid". The start time recorded with
    the pid guards against a reused pid.
    """
    from flowengine.shm.segment import LIVE, R_START, is_process_alive, reader_ctl_word

    me, killed = os.getpid(), []
    for seg in segments:
        try:
            for i in range(seg.num_readers):
                pid = seg.reader_pid(i)
                start = seg.words[reader_ctl_word(i) + R_START]
                if (seg.reader_state(i) == LIVE and pid and pid != me
                        and pid not in [k for k, _ in killed]
                        and is_process_alive(pid, start)):
                    logger.warning("reader slot %d of %s still held by pid %d of the "
                                   "old group: killing it", i, seg.name, pid)
                    try:
                        os.kill(pid, 9)
                    except OSError:
                        continue
                    killed.append((pid, start))
        except (OSError, ValueError):
            continue
    deadline = time.monotonic() + timeout_s
    while (any(is_process_alive(pid, start) for pid, start in killed)
           and time.monotonic() < deadline):
        time.sleep(0.05)
    return [pid for pid, _ in killed]


def run_driver(cfg: ProcConfig) -> None:
    """The driver process's body (flowengine.actors.procs, role "ray_driver")."""
    from flowengine.actors.procs import new_event_loop_factory

    started = time.monotonic()
    try:
        with asyncio.Runner(loop_factory=new_event_loop_factory()) as runner:
            runner.run(driver_main(cfg))
    except Exception as exc:  # noqa: BLE001 - the supervisor restarts the group
        logger.error("Ray driver of generation %d failed after %.1f s: %s",
                     cfg.generation, time.monotonic() - started, exc)
        sys.stderr.flush()
        os._exit(1)
