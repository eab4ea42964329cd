"""`flowengine bench ring`: our shared-memory ring vs pyzmq IPC vs multiprocessing.Queue.

    flowengine bench ring [--sizes 64,1024,65536] [--count 100000] [--latency-count 5000]
    python -m flowengine.bench.ring

For every message size and transport, a reader runs in its own spawned process and
this process writes. Each side uses the calls its users make:

- ring: the writer `RingWriter.send(bytes)`, one call per message (its fast path is
  `try_send`'s, which the engine's `Channel.send_async` calls; writers in the engine
  send one message per call, so the writer side is never batched here); the reader
  `RingReader.recv_many()`, which returns every message published so far (the call the
  engine's channels read with, `flowengine.shm.codec.Channel`).
- zmq: pyzmq PUSH/PULL over an `ipc://` socket in a temporary directory, `send` and
  `recv` (copying: pyzmq's fastest calls for small messages), one call per message on
  both sides, high-water mark `--zmq-hwm` (pyzmq's default 1000). pyzmq has no call
  that returns several queued messages.
- queue: `multiprocessing.Queue.put/get`, one call per message.

Messages are `bytes` of the given size whose first 8 bytes carry
`time.perf_counter_ns()` (CLOCK_MONOTONIC: one clock for all processes of a machine).
Three phases, after a warm-up:

- throughput: `count` messages (count/10 at 64 KiB and above) sent back to back;
  messages/s = count / (reader's clock at the last message - first message's stamp).
- latency (busy): the writer waits until the reader has received the previous message
  (an ack counter in shared memory, outside the transport under test), busy-waits
  `gap_us` more, and sends: the queue is empty and the message meets a waiting reader,
  ours in its spin phase. One-way latency = reader's clock at receipt - the stamp.
- latency (idle): the same, but the writer sleeps `idle_gap_ms` before each message:
  our reader has gone to sleep on its doorbell, so this is the wake-up latency.

On a machine shared with other busy processes every number moves; the load average
printed with the table says how quiet the machine was.
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing as mp
import os
import platform
import shlex
import struct
import sys
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

TRANSPORTS = ("ring", "zmq", "queue")
_STAMP = struct.Struct("<q")
_WARMUP = 100


@dataclass
class Result:
    transport: str
    size_bytes: int
    msgs_per_s: float
    p50_us: float
    p99_us: float
    idle_p50_us: float

    def row(self) -> str:
        mb_per_s = self.msgs_per_s * self.size_bytes / 1e6
        return (
            f"| {_size_label(self.size_bytes)} | {self.transport} | {self.msgs_per_s:,.0f} | "
            f"{mb_per_s:,.1f} | {self.p50_us:.1f} | {self.p99_us:.1f} | {self.idle_p50_us:.1f} |"
        )


def _size_label(size_bytes: int) -> str:
    return f"{size_bytes // 1024} KiB" if size_bytes >= 1024 else f"{size_bytes} B"


def _open_receiver(transport: str, address: Any, zmq_hwm: int) -> tuple[Any, Any, Any]:
    """(recv, recv_many or None, closer) for the reader's side.

    recv_many, where the transport has one, returns every message that has arrived
    (at least one): the ring's `RingReader.recv_many`, the call the engine's channels
    read with (flowengine.shm.codec.Channel). pyzmq and multiprocessing.Queue have no
    such call; their readers take one message per call, as their users do.
    """
    if transport == "ring":
        from flowengine.shm import RingReader

        reader = RingReader.attach(address)
        return reader.recv, reader.recv_many, reader.close
    if transport == "zmq":
        import zmq

        context = zmq.Context()
        sock = context.socket(zmq.PULL)
        sock.setsockopt(zmq.RCVHWM, zmq_hwm)
        sock.connect(address)
        return sock.recv, None, lambda: (sock.close(linger=0), context.term())
    return address.get, None, lambda: None  # a multiprocessing.Queue, inherited at spawn


def _reader_main(
    transport: str, address: Any, count: int, ack: Any, conn: Connection, zmq_hwm: int
) -> None:
    """Receive the phases, reporting each over `conn` so the writer starts the next one
    on an empty queue: "warm", (first stamp, last arrival), busy and idle latencies (ns).
    """
    recv, recv_many, close = _open_receiver(transport, address, zmq_hwm)
    clock = time.perf_counter_ns
    unpack = _STAMP.unpack_from
    for _ in range(_WARMUP):
        recv()
    conn.send("warm")
    if recv_many is None:
        first_stamp = unpack(recv())[0]
        for _ in range(count - 1):
            recv()
    else:
        batch = recv_many()
        first_stamp = unpack(batch[0])[0]
        received = len(batch)
        while received < count:
            received += len(recv_many())
    conn.send((first_stamp, clock()))
    for _ in range(2):  # busy, then idle latency phase; a negative stamp ends each
        lat_ns: list[int] = []
        while True:
            batch = [recv()] if recv_many is None else recv_many()
            now = clock()
            stamps = [unpack(data)[0] for data in batch]
            lat_ns.extend(now - stamp for stamp in stamps if stamp >= 0)
            ack.value = len(lat_ns)
            if stamps[-1] < 0:
                break
        conn.send(np.array(lat_ns, dtype=np.int64))
    close()


def _open_sender(transport: str, size_bytes: int, tmpdir: str, args: argparse.Namespace):
    """(send callable, address for the reader, closer) for the writer's side."""
    if transport == "ring":
        from flowengine.shm import RingWriter, create_ring

        segment = create_ring(f"bench{size_bytes}", args.ring_capacity_bytes, run_id=args.run_id)
        writer = RingWriter(segment)
        return writer.send, segment.name, lambda: (writer.close(), segment.close())
    if transport == "zmq":
        import zmq

        context = zmq.Context()
        sock = context.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, args.zmq_hwm)
        address = f"ipc://{tmpdir}/bench{size_bytes}.sock"
        sock.bind(address)
        return sock.send, address, lambda: (sock.close(linger=0), context.term())
    queue = mp.get_context("spawn").Queue()
    return queue.put, queue, queue.close


def run_one(transport: str, size_bytes: int, args: argparse.Namespace, tmpdir: str) -> Result:
    """Benchmark one transport at one message size (reader in a spawned process)."""
    count = args.count if size_bytes < 65536 else max(args.count // 10, 100)
    send, address, close = _open_sender(transport, size_bytes, tmpdir, args)
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    ack = ctx.RawValue("q", 0)  # messages received in the current latency phase
    reader = ctx.Process(
        target=_reader_main,
        args=(transport, address, count, ack, theirs, args.zmq_hwm),
        daemon=True,
    )
    reader.start()
    try:
        padding = bytes(size_bytes - _STAMP.size)
        clock, pack = time.perf_counter_ns, _STAMP.pack
        for _ in range(_WARMUP):
            send(pack(clock()) + padding)
        _expect(ours, transport)
        constant = pack(0) + padding
        send(pack(clock()) + padding)
        for _ in range(count - 1):
            send(constant)
        first_stamp, last_arrival = _expect(ours, transport)
        latencies = []
        for n, gap_ns, idle in (
            (args.latency_count, int(args.gap_us * 1000), False),
            (args.idle_count, int(args.idle_gap_ms * 1_000_000), True),
        ):
            ack.value = 0
            deadline_ns = clock() + int(args.phase_budget_s * 1e9)
            for i in range(n):
                while ack.value < i:  # the previous message has arrived
                    os.sched_yield()  # let the reader run on a crowded machine
                if clock() > deadline_ns:
                    break
                if idle:
                    time.sleep(gap_ns / 1e9)
                else:
                    until_ns = clock() + gap_ns
                    while clock() < until_ns:
                        pass
                send(pack(clock()) + padding)
            send(pack(-1) + padding)
            latencies.append(_expect(ours, transport))
        reader.join(30)
    finally:
        if reader.is_alive():
            reader.kill()
        close()
    busy_ns, idle_ns = latencies
    return Result(
        transport,
        size_bytes,
        count * 1e9 / (last_arrival - first_stamp),
        float(np.percentile(busy_ns, 50)) / 1e3,
        float(np.percentile(busy_ns, 99)) / 1e3,
        float(np.percentile(idle_ns, 50)) / 1e3,
    )


def _expect(conn: Connection, transport: str) -> Any:
    if not conn.poll(300):
        raise RuntimeError(f"{transport} reader did not report within 300 s")
    return conn.recv()


def _parse(argv: list[str], prog: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="64,1024,65536", help="message sizes in bytes")
    parser.add_argument("--transports", default=",".join(TRANSPORTS))
    parser.add_argument("--count", type=int, default=100_000, help="throughput messages")
    parser.add_argument("--latency-count", type=int, default=5000)
    parser.add_argument("--gap-us", type=float, default=10.0, help="busy-latency pacing")
    parser.add_argument("--idle-count", type=int, default=200)
    parser.add_argument("--idle-gap-ms", type=float, default=2.0, help="idle-latency pacing")
    parser.add_argument(
        "--phase-budget-s", type=float, default=3.0, help="cap on each latency phase's time"
    )
    parser.add_argument("--ring-capacity-bytes", type=int, default=8 << 20)
    parser.add_argument(
        "--zmq-hwm", type=int, default=1000, help="pyzmq send/receive high-water mark (0: none)"
    )
    args = parser.parse_args(argv)
    args.sizes = [int(s) for s in args.sizes.split(",")]
    args.transports = args.transports.split(",")
    for size in args.sizes:
        if size < _STAMP.size:
            parser.error(f"--sizes: {size} is below the {_STAMP.size}-byte timestamp")
    for transport in args.transports:
        if transport not in TRANSPORTS:
            parser.error(f"--transports: {transport!r} is not one of {', '.join(TRANSPORTS)}")
    if "zmq" in args.transports and importlib.util.find_spec("zmq") is None:
        parser.error("--transports: pyzmq is not installed (pip install pyzmq), or leave out zmq")
    return args


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main(argv: list[str] | None = None, prog: str = "flowengine bench ring") -> int:
    """Run the benchmark and print a markdown table; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    args = _parse(argv, prog)
    from flowengine.shm import new_run_id

    args.run_id = new_run_id()
    print(f"command: {prog} {shlex.join(argv)}".rstrip())
    print(
        f"machine: {os.cpu_count()}-core {_cpu_model()}, Python {platform.python_version()}, "
        f"load average before: {os.getloadavg()[0]:.2f}"
    )
    print()
    print("| size | transport | msgs/s | MB/s | p50 µs | p99 µs | idle p50 µs |")
    print("|---|---|---:|---:|---:|---:|---:|")
    results = []
    with tempfile.TemporaryDirectory(prefix="fe-bench-") as tmpdir:
        for size in args.sizes:
            for transport in args.transports:
                result = run_one(transport, size, args, tmpdir)
                results.append(result)
                print(result.row(), flush=True)
    _print_ratios(results)
    return 0


def _print_ratios(results: list[Result]) -> None:
    by_key = {(r.transport, r.size_bytes): r for r in results}
    lines = []
    for (transport, size), ring in sorted(by_key.items(), key=lambda kv: kv[0][1]):
        zmq = by_key.get(("zmq", size))
        if transport == "ring" and zmq is not None:
            lines.append(
                f"- {_size_label(size)}: ring/zmq throughput {ring.msgs_per_s / zmq.msgs_per_s:.2f}x, "
                f"p50 latency ring/zmq {ring.p50_us / zmq.p50_us:.2f}"
            )
    if lines:
        print()
        print("\n".join(lines))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:], prog="python -m flowengine.bench.ring"))
