"""Client processes for `flowengine bench serve --num-client-processes N`.

One Python process that parses ~90,000 streamed tokens/s (a GPU server at concurrency
256) is itself the bottleneck: it notices completions and sends the next request late,
so it measures its own delays in TTFT and keeps fewer requests in flight than asked.
N processes, each running `serve_client.run_load` on its share, lift that limit.

The coordinator (`run_client_processes`) deals the requests round-robin to N
`python -m flowengine.bench.serve_worker` processes. Messages are JSON lines (orjson),
never pickle:

    parent -> worker stdin   the job: the `ClientJob` fields
    worker -> parent stdout  "ready" (imported, HTTP client open)
    parent -> worker stdin   {"start_time": wall-clock s}, the same for every worker
    worker -> parent stdout  {"start_time": s, "end_time": s, "results": [RequestResult fields]}

The parent holds each worker's stdin open until the worker exits; a worker that sees
EOF sooner stops (its coordinator died, even by SIGKILL). A worker that exits non-zero
or reports anything else has its requests counted as failed, with its exit code and
stderr tail; the parent kills every worker still running when it returns or is
interrupted.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import orjson

from flowengine.bench.serve_client import ClientJob, open_client, run_load
from flowengine.bench.serve_dataset import BenchRequest
from flowengine.bench.serve_metrics import RequestResult

WORKER_MODULE = "flowengine.bench.serve_worker"
READY = b"ready\n"
READY_TIMEOUT_S = 60.0  # import and client setup take ~0.3 s; a worker slower than this is hung
MAX_JOB_BYTES = 1 << 30  # the job is one JSON line: every prompt of the worker's share
START_DELAY_S = 0.25  # from the "go" line to the common start: time for every worker to read it


@dataclass(frozen=True)
class WorkerExit:
    """What one finished worker left: its exit code, its report line, its stderr."""

    returncode: int
    report: bytes
    stderr: bytes


def split_job(job: ClientJob, num_processes: int) -> list[ClientJob]:
    """Worker i gets requests i, i + N, ...; max_concurrency // N slots, plus one for the
    first max_concurrency % N workers; request_rate / N; seed + i.

    NOTE: needs 1 <= N <= min(max_concurrency, len(requests)) (serve._validate checks);
    a worker with no slot would wait forever.
    """
    # N independent Poisson streams at rate / N add up to one Poisson stream at rate
    # (burstiness 1). Gamma streams (other burstiness) add up to a stream closer to Poisson.
    limit, n = job.max_concurrency, num_processes
    return [
        replace(
            job,
            requests=job.requests[i::n],
            max_concurrency=limit // n + int(i < limit % n),
            request_rate=job.request_rate / n,
            seed=job.seed + i,
        )
        for i in range(n)
    ]


def merge_reports(
    requests: Sequence[BenchRequest],
    exits: Sequence[WorkerExit],
    start_time: float,
    end_time: float,
) -> tuple[list[RequestResult], float]:
    """Results in request order (worker i held requests i, i + N, ...) and the duration in
    seconds from the first worker's start to the last one's end (`start_time` and
    `end_time` if no worker reported). A worker without a valid report gets one failed
    result per request, its error naming the worker's exit code and stderr tail."""
    n = len(exits)
    results: list[RequestResult] = [RequestResult() for _ in requests]
    starts, ends = [], []
    for i, worker in enumerate(exits):
        share = requests[i::n]
        try:
            start, end, share_results = _parse_report(worker, len(share))
        except ValueError as err:
            share_results = [RequestResult(prompt_len=r.prompt_len, error=str(err)) for r in share]
        else:
            starts.append(start)
            ends.append(end)
        results[i::n] = share_results
    return results, max(ends, default=end_time) - min(starts, default=start_time)


def _parse_report(
    worker: WorkerExit, num_requests: int
) -> tuple[float, float, list[RequestResult]]:
    if worker.returncode != 0:
        tail = worker.stderr.decode(errors="replace").strip()[-500:] or "(no stderr)"
        raise ValueError(f"client process exited with code {worker.returncode}: {tail}")
    try:
        report = orjson.loads(worker.report)
        results = [RequestResult(**fields) for fields in report["results"]]
        start, end = float(report["start_time"]), float(report["end_time"])
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(
            f"client process sent a bad report ({type(err).__name__}: {err}): "
            f"{worker.report[:200]!r}"
        ) from None
    if len(results) != num_requests:
        raise ValueError(f"client process reported {len(results)} results for {num_requests}")
    return start, end, results


async def run_client_processes(
    job: ClientJob, num_processes: int, on_done: Callable[[int], object]
) -> tuple[list[RequestResult], float]:
    """Run the job over `num_processes` worker processes (see the module docstring);
    returns the merged results and the duration in seconds. `on_done(k)` is called when
    a worker has finished its k requests."""
    jobs = split_job(job, num_processes)
    procs: list[asyncio.subprocess.Process] = []
    stderrs: list[asyncio.Future[bytes]] = []
    try:
        for _ in jobs:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", WORKER_MODULE,
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip
            procs.append(proc)
            stderrs.append(asyncio.ensure_future(proc.stderr.read()))
        # Concurrently: a job of many prompts fills the pipe until its worker has imported.
        await asyncio.gather(*(_send(p, orjson.dumps(j)) for p, j in zip(procs, jobs, strict=True)))
        firsts = await asyncio.gather(*(_first_line(p) for p in procs))
        start_time = time.time() + START_DELAY_S
        for proc, first in zip(procs, firsts, strict=True):
            if first == READY:
                await _send(proc, orjson.dumps({"start_time": start_time}))
            else:
                proc.stdin.close()  # it exits on EOF

        async def finish(
            proc: asyncio.subprocess.Process,
            first: bytes,
            stderr: asyncio.Future[bytes],
            share: ClientJob,
        ) -> WorkerExit:
            rest = await proc.stdout.read()
            returncode = await proc.wait()
            on_done(len(share.requests))
            return WorkerExit(returncode, rest if first == READY else first + rest, await stderr)

        exits = await asyncio.gather(*map(finish, procs, firsts, stderrs, jobs))
        return merge_reports(job.requests, exits, start_time, time.time())
    finally:
        for proc in procs:
            proc.stdin.close()
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):  # exited, not yet reaped
                    proc.kill()
                await proc.wait()
        for stderr in stderrs:
            stderr.cancel()


async def _send(proc: asyncio.subprocess.Process, data: bytes) -> None:
    try:
        proc.stdin.write(data + b"\n")
        await proc.stdin.drain()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the worker died; its exit code and stderr tell why


async def _first_line(proc: asyncio.subprocess.Process) -> bytes:
    """The worker's "ready" line, or whatever it wrote instead; kills a hung worker."""
    try:
        return await asyncio.wait_for(proc.stdout.readline(), READY_TIMEOUT_S)
    except TimeoutError:
        proc.kill()
        return b""


def _read_job(line: bytes) -> ClientJob:
    fields = orjson.loads(line)
    fields["requests"] = [BenchRequest(**r) for r in fields["requests"]]
    if fields["request_rate"] is None:  # JSON has no infinity; orjson writes inf as null
        fields["request_rate"] = math.inf
    return ClientJob(**fields)


async def _work() -> dict[str, Any]:
    stdin = asyncio.StreamReader(limit=MAX_JOB_BYTES)
    loop = asyncio.get_running_loop()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)
    job = _read_job(await stdin.readline())
    async with open_client(job) as client:
        sys.stdout.buffer.write(READY)
        sys.stdout.buffer.flush()
        go = orjson.loads(await stdin.readline())
        await asyncio.sleep(max(0.0, go["start_time"] - time.time()))
        start_time = time.time()
        run = asyncio.ensure_future(run_load(client, job))
        # NOTE: the coordinator holds stdin open until this process exits; EOF before the
        # run ends means it died (even by SIGKILL), so stop sending rather than orphaned.
        orphaned = asyncio.ensure_future(stdin.read())
        await asyncio.wait([run, orphaned], return_when=asyncio.FIRST_COMPLETED)
        orphaned.cancel()
        if not run.done():
            run.cancel()
            raise SystemExit("the coordinator closed stdin before the run ended")
        end_time = time.time()
    return {"start_time": start_time, "end_time": end_time, "results": run.result()}


def main() -> int:
    """Worker entry point: one job from stdin, one report to stdout."""
    report = asyncio.run(_work())
    sys.stdout.buffer.write(orjson.dumps(report) + b"\n")
    sys.stdout.buffer.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
