"""Entry points of the engine and executor processes (DESIGN.md §1, §8).

The supervisor starts each as a fresh interpreter (spawn semantics):

    python -m flowengine.actors.procs '<ProcConfig as JSON>'

The configuration travels as msgspec JSON on the command line and every message over
shared-memory rings as msgpack, so no pickle is involved anywhere, not even in the
bootstrap (multiprocessing's spawn would pickle its arguments).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import sys
import threading
import time
from typing import Any

import msgspec

from flowengine.config import EngineArgs
from flowengine.engine.gc_utils import freeze_startup_heap

logger = logging.getLogger(__name__)


class RingNames(msgspec.Struct, frozen=True):
    """Segment names of one engine run's channels (DESIGN.md §1).

    client_requests, client_outputs: the requests and outputs rings of API server
    processes 1..N-1 (`flowengine serve --api-server-count N`); empty with one.
    """

    requests: str
    outputs: str
    steps: str
    results: str
    client_requests: tuple[str, ...] = ()
    client_outputs: tuple[str, ...] = ()


class APIServerAttach(msgspec.Struct, frozen=True):
    """What API server process `index` (1..N-1 of `--api-server-count N`) needs to
    join the running engine: its own rings, the engine generation current when it
    starts, and the KV cache size the engine reported (for the frontend's length
    limits)."""

    index: int
    requests: str
    outputs: str
    generation: int = 0
    num_kv_blocks: int = 0
    run_id: str = ""  # the run's segment prefix "fe-<run_id>-" (its shared stats files)
    count: int = 2  # API server processes in all


class ProcConfig(msgspec.Struct, frozen=True):
    """One process's start-up configuration (its command-line argument).

    dist_init_method: the tensor-parallel rendezvous ("tcp://127.0.0.1:PORT", a fresh
    port per group) when tensor_parallel_size > 1, else "".
    ready_timeout_s: how long the engine waits for its executor's ExecutorReady (the
    supervisor's FLOWENGINE_ENGINE_READY_TIMEOUT_S) before it exits with an error.
    dp_rank: the data-parallel replica; its executors drive GPUs
    dp_rank * tensor_parallel_size * pipeline_parallel_size + rank.
    rank: the executor's global rank in its group: tensor-parallel rank
    rank % tensor_parallel_size of pipeline stage rank // tensor_parallel_size.
    """

    role: str  # "engine" | "executor" | "ray_driver" (the executor ranks as Ray actors)
    engine_args: EngineArgs
    rings: RingNames
    rank: int = 0
    generation: int = 0
    dist_init_method: str = ""
    ready_timeout_s: float = 600.0
    dp_rank: int = 0  # data-parallel replica of the group


# Test hook (the restart soak, tests/actors): the engine process sleeps this long
# before it attaches to any ring, "S" seconds or "LO-HI" for a uniformly random delay,
# so its executor's ExecutorReady is written before the engine reads "results".
START_DELAY_ENV = "FLOWENGINE_TEST_ENGINE_START_DELAY_S"


def start_delay_s(spec: str | None) -> float:
    """Seconds from a START_DELAY_ENV value ("2.5" or "0-5"); 0 for None/"".
    Raises ValueError for anything else."""
    if not spec:
        return 0.0
    lo, sep, hi = spec.partition("-")
    try:
        low = float(lo)
        high = float(hi) if sep else low
    except ValueError:
        raise ValueError(f"{START_DELAY_ENV}={spec!r}: expected seconds or LO-HI") from None
    if not 0 <= low <= high:
        raise ValueError(f"{START_DELAY_ENV}={spec!r}: expected 0 <= LO <= HI")
    return random.uniform(low, high)


async def engine_main(cfg: ProcConfig) -> None:
    """Scheduler actor: requests ring in, steps ring out, results in, outputs out."""
    from flowengine.actors.scheduler import SchedulerActor
    from flowengine.engine.builder import build_scheduler, resolve
    from flowengine.engine.engine_core import EngineCore
    from flowengine.messages import (
        EngineOutputs,
        ExecutorReady,
        RequestsMsg,
        ResultsMsg,
        StepsMsg,
    )
    from flowengine.shm import BroadcastWriter, Channel, RingReader, RingWriter

    delay_s = start_delay_s(os.environ.get(START_DELAY_ENV))
    if delay_s:
        logger.warning("%s: starting %.2f s late", START_DELAY_ENV, delay_s)
        await asyncio.sleep(delay_s)
    resolved = resolve(cfg.engine_args)
    requests = [Channel(RingReader.attach(name), RequestsMsg)
                for name in (cfg.rings.requests, *cfg.rings.client_requests)]
    outputs = [Channel(RingWriter.attach(name), EngineOutputs)
               for name in (cfg.rings.outputs, *cfg.rings.client_outputs)]
    steps = Channel(BroadcastWriter.attach(cfg.rings.steps), StepsMsg)
    results = Channel(RingReader.attach(cfg.rings.results), ResultsMsg)
    try:
        # The supervisor reset this slot before the group started, so the executor's
        # one-shot ExecutorReady is kept here however late we attach (DESIGN.md §8).
        ready = await asyncio.wait_for(results.recv_async(), cfg.ready_timeout_s)
    except TimeoutError:
        raise RuntimeError(
            f"no ExecutorReady from executor rank 0 within {cfg.ready_timeout_s:g} s "
            "(FLOWENGINE_ENGINE_READY_TIMEOUT_S)") from None
    if not isinstance(ready, ExecutorReady):
        raise RuntimeError(f"expected ExecutorReady from rank 0, got {type(ready).__name__}")
    scheduler = build_scheduler(resolved, ready.num_kv_blocks)
    requests_in, outputs_out = _client_channels(requests, outputs, scheduler, cfg.generation)
    pp = cfg.engine_args.pipeline_parallel_size
    actor = SchedulerActor(
        EngineCore(scheduler, None, resolved.max_model_len), requests_in, steps, results,
        outputs_out,
        # Pipeline parallelism: one micro-batch in flight per stage (vLLM's), each
        # request in one of them at a time (no placeholders: async scheduling is off).
        max_steps_in_flight=pp if pp > 1 else 2 if cfg.engine_args.async_scheduling else 1,
        async_scheduling=cfg.engine_args.async_scheduling and pp == 1,
        generation=cfg.generation,
        offload_grammar=False,  # nothing else runs on this loop (scheduler.py)
    )
    freeze_startup_heap()
    # The ready message (to every API server): the frontends resubmit in-flight requests
    # after it.
    await outputs_out.send_async(
        EngineOutputs([], time.time(), scheduler.make_stats(), cfg.generation)
    )
    await actor.run()


def _client_channels(requests: list[Any], outputs: list[Any], scheduler: Any,
                     generation: int) -> tuple[Any, Any]:
    """One requests inbox and one outputs outbox over the API servers' rings: the
    rings themselves with one API server, else the router's channels
    (flowengine/actors/clients.py)."""
    if len(requests) == 1:
        return requests[0], outputs[0]
    from flowengine.actors.clients import ClientOutputs, ClientRequests
    from flowengine.engine.client_router import ClientRouter

    router = ClientRouter(len(requests), lambda rid: scheduler.get_request(rid) is not None)
    outputs_out = ClientOutputs(outputs, router, generation)
    return ClientRequests(requests, router, outputs_out), outputs_out


async def _inline(fn: Any, *args: Any) -> Any:
    # The executor process has nothing else to do while the model runs.
    return fn(*args)


async def executor_main(cfg: ProcConfig, steps: Any = None, results: Any = None) -> None:
    """Executor of one rank (tensor-parallel rank of a pipeline stage; + Sampler on
    tensor-parallel rank 0 of the last stage): steps ring in, results ring out (the
    sampling rank only, the ring's one writer). `steps`/`results`: channels to use
    instead of the rings (a Ray actor on another node: flowengine/executor/
    ray_executor.py)."""
    import torch

    from flowengine.actors.executor import ExecutorActor
    from flowengine.distributed.tp_group import init_parallel
    from flowengine.engine.builder import build_executor, resolve
    from flowengine.messages import ExecutorReady, ResultsMsg, StepsMsg
    from flowengine.shm import Channel, RingReader, RingWriter

    resolved = resolve(cfg.engine_args)
    tp_size = cfg.engine_args.tensor_parallel_size
    pp_size = cfg.engine_args.pipeline_parallel_size
    # CPU threads: build_executor sets them (flowengine/executor/cpu_threads.py).
    device = torch.device(resolved.device)
    if device.type == "cuda":
        from flowengine.executor.cuda_stage import local_gpu_index

        # Rank r of replica d drives GPU d * tp * pp + r (the one GPU a Ray actor sees);
        # "cuda" means it below, and NCCL joins the ranks' GPUs (init_parallel).
        gpu = local_gpu_index(cfg.dp_rank, tp_size, pp_size, cfg.rank,
                              torch.cuda.device_count())
        torch.cuda.set_device(gpu)
        device = torch.device("cuda", gpu)
    tp, pp = init_parallel(cfg.rank, tp_size, pp_size, cfg.dist_init_method, device,
                           resolved.model_config.num_layers)
    if steps is None:
        steps = Channel(RingReader.attach(cfg.rings.steps, reader_index=cfg.rank), StepsMsg)
    executor, num_blocks = build_executor(resolved, tp, pp)
    freeze_startup_heap()
    try:
        if not (tp.is_first and pp.is_last):
            await ExecutorActor(executor, steps, None, blocking=_inline).run()
            return
        if results is None:
            results = Channel(RingWriter.attach(cfg.rings.results), ResultsMsg)
        await results.send_async(ExecutorReady(num_blocks, cfg.rank))
        await ExecutorActor(executor, steps, results, blocking=_inline).run()
    finally:
        if tp.world_size * pp.size > 1:
            torch.distributed.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cfg = msgspec.json.decode(argv[0], type=ProcConfig)
    logging.basicConfig(
        level=os.environ.get("FLOWENGINE_LOG_LEVEL", "WARNING"),
        format=f"%(asctime)s {cfg.role}{cfg.rank} %(levelname)s %(name)s: %(message)s",
    )
    # The frontend owns shutdown: Ctrl-C reaches the whole process group, and so does
    # SIGTERM from `timeout` or from systemd's KillMode=control-group; the frontend
    # answers either by draining and sending Shutdown down the rings (SIGKILL, or the
    # frontend's death, still ends this process).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    exit_with_parent(cfg.rings)
    if cfg.role == "ray_driver":
        from flowengine.executor.ray_executor import run_driver

        run_driver(cfg)
        return 0
    from flowengine.engine import step_trace

    step_trace.start(f"{cfg.role}{cfg.rank}")
    coro = engine_main(cfg) if cfg.role == "engine" else executor_main(cfg)
    try:
        with asyncio.Runner(loop_factory=new_event_loop_factory()) as runner:
            runner.run(coro)
    finally:
        step_trace.dump()
    return 0


def exit_with_parent(rings: RingNames | None = None, poll_s: float = 1.0) -> None:
    """Exit when the frontend process that started this one is gone (killed, crashed):
    an orphaned engine or executor would otherwise hold its memory (and GPU) forever.
    A daemon thread polls the parent pid every `poll_s` seconds. Before exiting it
    removes the dead frontend's ring segments and semaphores of this run (`rings`):
    the frontend owned them and cannot (kill -9); whichever child notices first removes
    them, and the next start's cleanup_stale catches what a killed group left."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                logger.warning("the frontend process %d is gone; exiting", parent)
                if rings is not None:
                    remove_run_segments(rings)
                os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def remove_run_segments(rings: RingNames) -> None:
    """Unlink this run's segments and semaphores whose creator (the frontend) is dead;
    never raises (called on the way out)."""
    from flowengine.shm import cleanup_stale

    run_prefix = rings.requests.lstrip("/").rsplit("-", 1)[0] + "-"  # "fe-<run_id>-"
    try:
        cleanup_stale(run_prefix)
        # The API server processes' stats files (plain files, no ring header).
        from flowengine.engine.frontend_stats import remove_run_files

        remove_run_files(run_prefix)
    except Exception as exc:  # noqa: BLE001 - best effort; the next start retries
        logger.warning("could not remove the run's segments: %r", exc)


def new_event_loop_factory() -> Any:
    """uvloop's loop where available (the client's choice), else asyncio's."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.new_event_loop
    return uvloop.new_event_loop


if __name__ == "__main__":
    raise SystemExit(main())
