"""`AsyncEngine`: the async `submit()` API over the actor pipeline (DESIGN.md §1, §7).

    engine = AsyncEngine(max_model_len=2048)          # any EngineArgs field
    await engine.start()
    async for out in engine.submit("Hello", SamplingParams(max_tokens=16),
                                   output_kind=RequestOutputKind.DELTA):
        print(out.outputs[0].text, end="")
    await engine.shutdown()

Placement `inproc` runs every actor in this process (the model forward in a worker
thread); `multiproc` runs the scheduler in an engine process and each executor in its
own process, over shared-memory rings, under a supervisor that restarts them.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import anyio
import anyio.to_thread
import msgspec

from flowengine.actors.base import Channel
from flowengine.actors.detokenizer import DetokenizerActor
from flowengine.actors.ingress import IngressActor
from flowengine.actors.procs import APIServerAttach
from flowengine.actors.streamer import StreamerActor
from flowengine.actors.tokenizer import TokenizerActor
from flowengine.beam_search import BeamSearchOutput, BeamSearchParams
from flowengine.config import EngineArgs, with_settled_defaults
from flowengine.engine.gc_utils import (
    freeze_startup_heap,
    raise_gen0_threshold,
    restore_gc_threshold,
    thaw_heap,
)
from flowengine.engine.output_processor import OutputProcessor
from flowengine.engine.protocol import EngineDeadError, EngineStats
from flowengine.messages import AbortRequest, Shutdown
from flowengine.outputs import RequestOutput
from flowengine.pooling.params import EmbeddingRequestOutput, PoolingParams
from flowengine.sampling_params import RequestOutputKind, SamplingParams
from flowengine.shm.inproc import InprocChannel

logger = logging.getLogger(__name__)

DEFAULT_MAX_QUEUE_LEN = 4096


async def beam_search(
    engine: Any, prompt: Any, params: BeamSearchParams, *, priority: int = 0,
    fit_max_tokens: bool = False, truncate_prompt_tokens: int | None = None,
) -> tuple[BeamSearchOutput, int]:
    """Beam search on any EngineClient through `submit` (the server's path: the event
    loop keeps serving while the steps run). Scoring and KV sharing as `LLM.beam_search`
    (flowengine/beam_search.py).

    prompt: what `submit` takes (text, token ids, a dict, a conversation); the first
    step sends it as given, later steps send the prompt's token ids plus each beam's.
    fit_max_tokens: lower params.max_tokens to the context the prompt leaves (vLLM's
    rule for a request without max_tokens) instead of refusing a longer one.
    truncate_prompt_tokens: search from the prompt's last k tokens (-1: max_model_len),
    as SamplingParams.truncate_prompt_tokens.
    Returns (the output, the prompt's number of tokens, after truncation).

    Raises ValueError/TypeError for bad input (a prompt plus max_tokens over
    max_model_len; 2 * beam_width over the engine's max_logprobs) before the search
    grows, EngineOverloadedError/EngineDeadError as `submit`, RuntimeError when a step
    fails in the engine. Cancelling aborts the step's requests.
    """
    from flowengine.beam_search import (
        BeamSearch,
        check_request,
        step_params,
        step_prompt,
        top_logprobs,
    )

    processor = getattr(getattr(engine, "tokenizer_actor", None), "input_processor", None)
    if processor is not None:
        eos = [] if processor.eos_token_id is None else [processor.eos_token_id]
        eos += [t for t in processor.extra_eos_token_ids if t not in eos]
        max_logprobs = processor.max_logprobs
    else:  # another EngineClient: its tokenizer's EOS, its own limits
        eos_id = getattr(engine.get_tokenizer(), "eos_token_id", None)
        eos = [] if eos_id is None else [eos_id]
        max_logprobs = -1
    step = step_params(params, len(eos))

    async def run_one(
        one_prompt: Any, step: SamplingParams = step
    ) -> tuple[list[int], dict[int, float]]:
        """(prompt token ids, the step's top log-probabilities) of one beam request;
        the token and its logprobs may come in another delta than the finish."""
        prompt_ids, lps, error = None, None, None
        async for out in engine.submit(one_prompt, step, priority=priority):
            prompt_ids = out.prompt_token_ids
            error = out.error or error
            if out.outputs and out.outputs[0].logprobs and lps is None:
                lps = top_logprobs(out.outputs[0].logprobs[0])
        if prompt_ids is None or error is not None or lps is None:
            raise RuntimeError(f"a beam-search step failed: {error or 'no log-probabilities'}")
        return prompt_ids, lps

    check_request(params, 0, engine.max_model_len, max_logprobs, len(eos))
    # The first step truncates the prompt; later steps extend the truncated ids.
    first_step = msgspec.structs.replace(step, truncate_prompt_tokens=truncate_prompt_tokens)
    prompt_ids, first = await run_one(prompt, first_step)
    if fit_max_tokens:
        room = engine.max_model_len - len(prompt_ids)
        if room < params.max_tokens:
            params = replace(params, max_tokens=max(1, room))
    search = BeamSearch(prompt_ids, params, eos)
    check_request(params, len(prompt_ids), engine.max_model_len, max_logprobs, len(eos))
    search.advance([first])
    while not search.done:
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(run_one(step_prompt(ids, prompt)))
                         for ids in search.beam_inputs()]
        except* Exception as group:  # the first failure; the others were cancelled
            first_error = group.exceptions[0]
        else:
            first_error = None
        if first_error is not None:
            raise first_error
        search.advance([t.result()[1] for t in tasks])
    tokenizer = engine.get_tokenizer()
    return (search.output(lambda t: tokenizer.decode(t, skip_special_tokens=False)),
            len(search.prompt_token_ids))


class AsyncEngine:
    """Async engine; implements `flowengine.engine.protocol.EngineClient`.

    Args:
        model: as for `LLM` (None = default model).
        max_queue_len: requests in flight before `submit` raises EngineOverloadedError.
        api_server_count: frontend processes the engine serves (`flowengine serve
            --api-server-count`): this engine is the first and owns the engine
            processes; `api_server_attach(i)` tells process i how to join. Needs the
            multiproc placement and one data-parallel replica (ValueError otherwise).
        attach: join an engine that another process started (API server i >= 1)
            instead of starting one; its supervisor restarts the engine, this one
            resubmits its own requests after a restart.
        **engine_args: `EngineArgs` fields (vLLM names); unknown names raise TypeError.
    """

    def __init__(
        self, model: str | None = None, *, max_queue_len: int = DEFAULT_MAX_QUEUE_LEN,
        core_factory: Callable[[Any], Any] | None = None, api_server_count: int = 1,
        attach: APIServerAttach | None = None, **engine_args: Any,
    ) -> None:
        self.args = EngineArgs.from_kwargs(model=model, **engine_args)
        self.max_queue_len = max_queue_len
        if api_server_count < 1:
            raise ValueError(f"api_server_count must be >= 1, got {api_server_count}")
        self.api_server_count = api_server_count
        self._attach = attach
        self._check_api_server_count()
        # Builds the in-process EngineCore from the ResolvedEngine; `flowengine bench
        # pipeline` passes one with a null model. Default: the real model.
        self._core_factory = core_factory
        self._started = False
        self._start_lock = asyncio.Lock()
        self._dead: EngineDeadError | None = None
        self._shutting_down = False
        self._task: asyncio.Task | None = None
        self._children: dict[str, list[str]] = {}
        self._dead_callbacks: list[Callable[[EngineDeadError], None]] = []
        self._gc_threshold: tuple[int, ...] | None = None
        # KV blocks the engine reported at start-up (the smallest replica's under data
        # parallelism): what get_stats() says before the first stats message arrives,
        # so the server's default --max-queue-len sees the real count.
        self._startup_num_kv_blocks = 0

    @classmethod
    def from_engine_args(cls, args: EngineArgs, max_queue_len: int = DEFAULT_MAX_QUEUE_LEN,
                         **kwargs: Any):
        """From built EngineArgs; kwargs: `api_server_count`, `attach` (see the class)."""
        engine = cls.__new__(cls)
        AsyncEngine.__init__(engine, max_queue_len=max_queue_len, **kwargs)
        engine.args = args
        engine._check_api_server_count()
        return engine

    def _check_api_server_count(self) -> None:
        if self.api_server_count > 1 and (self.args.placement == "inproc"
                                          or self.args.data_parallel_size > 1):
            raise ValueError(
                "api_server_count > 1 needs placement multiproc (or auto) and "
                f"data_parallel_size 1, got placement {self.args.placement!r} and "
                f"data_parallel_size {self.args.data_parallel_size}")

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Load the model and start the actors (idempotent)."""
        async with self._start_lock:
            if self._started:
                return
            await self._start()
            self._started = True

    async def _start(self) -> None:
        from flowengine.engine.builder import load_engine_tokenizer, make_input_processor, resolve

        if self.api_server_count > 1 and self.args.placement == "auto":
            # Several frontends share one engine over rings: it needs its own process.
            self.args = replace(self.args, placement="multiproc")
        # A core_factory builds the core in this process (`flowengine bench pipeline`).
        frontend = self._core_factory is None
        self.resolved = await anyio.to_thread.run_sync(
            lambda: resolve(self.args, frontend=frontend))
        # The caller's args with the placement and async scheduling resolve() settled.
        self.args = with_settled_defaults(self.args, self.resolved.args)
        self.model_name = self.resolved.served_model_names[0]
        self.max_model_len = self.resolved.max_model_len
        self.tokenizer = await anyio.to_thread.run_sync(load_engine_tokenizer, self.resolved)
        if self._attach is not None:
            self.requests, self.outputs, engine_actors = await self._start_attached()
        elif self.args.placement == "inproc":
            self.requests, self.outputs, engine_actors = await self._start_inproc()
        elif self.args.data_parallel_size > 1:
            self.requests, self.outputs, engine_actors = await self._start_data_parallel()
        else:
            from flowengine.actors.supervisor import Supervisor

            self.supervisor = Supervisor(
                self.resolved,
                expect_generation=lambda g: self.detokenizer.expect_generation(g),
                resubmit=self._resubmit_after_restart,
                has_work=self._has_unfinished_requests,
                num_api_servers=self.api_server_count,
            )
            ready = await self.supervisor.start()
            if ready.stats is not None:
                self._fit_max_model_len(ready.stats.num_total_blocks)
            self.requests, self.outputs = self.supervisor.requests, self.supervisor.outputs
            engine_actors = [self.supervisor]
            self.supervisors = [self.supervisor]
        input_processor = make_input_processor(self.tokenizer, self.resolved)
        # The model's sampling defaults (generation_config.json): the serving layer
        # fills unset request fields from them (vLLM's default_sampling_params).
        self.default_sampling_params = dict(input_processor.default_sampling_params)
        self.chat_template = input_processor.chat_template  # --chat-template text or None
        self.streamer = StreamerActor(on_orphan=self._abort_orphan)
        self.detokenizer = DetokenizerActor(
            # Each request's SamplingParams.output_kind picks its outputs (submit sets it).
            OutputProcessor(self.tokenizer, stream_interval=self.args.stream_interval),
            self.outputs,
            self.requests,
            self.streamer,
            max_model_len=self.max_model_len,
            on_new_generation=self._resubmit_own if self._attach is not None else None,
        )
        if self._attach is not None:
            self.detokenizer.generation = self._attach.generation
        self.tokenizer_actor = TokenizerActor(input_processor, self.detokenizer, self.requests)
        request_logger = None
        if self.args.enable_log_requests:
            from flowengine.engine.request_logger import RequestLogger

            request_logger = RequestLogger(self.args.max_log_len)
        self.ingress = IngressActor(self.tokenizer_actor, self.streamer, self.max_queue_len,
                                    request_logger)
        # The tokenizer is a call in each request's path (IngressActor.admit), no task,
        # as is the Streamer (StreamerActor.route, called by the Detokenizer).
        actors = [self.detokenizer, *engine_actors]
        self._shared_stats = None
        if self._attach is not None or self.api_server_count > 1:
            from flowengine.engine.frontend_stats import SharedFrontendStats

            run_id, index, count = ((self._attach.run_id, self._attach.index, self._attach.count)
                                    if self._attach is not None else
                                    (self.supervisor.run_id, 0, self.api_server_count))
            self._shared_stats = SharedFrontendStats(run_id, index, count)
            actors.append(_StatsPublisher(self._shared_stats, self._local_stats))
        # Process 0 logs the totals of every API server process (get_stats sums them).
        if not self.args.disable_log_stats and self._attach is None:
            from flowengine.engine.stat_logger import StatLoggerActor

            actors.append(StatLoggerActor(self.get_stats))
        self._task = asyncio.get_running_loop().create_task(self._run(actors))
        freeze_startup_heap()
        # Each step's outputs are allocated and freed within the step: no young
        # collection in between (gc_utils.raise_gen0_threshold).
        self._gc_threshold = raise_gen0_threshold(self.args.max_num_seqs)

    async def _start_attached(self) -> tuple[Any, Any, list[Any]]:
        """API server `attach.index` >= 1: its own rings into the running engine."""
        from flowengine.messages import ClientStart, EngineOutputs, RequestsMsg
        from flowengine.shm import Channel as RingChannel
        from flowengine.shm import RingReader, RingWriter

        attach = self._attach
        assert attach is not None
        requests = RingChannel(RingWriter.attach(attach.requests), RequestsMsg)
        outputs = RingChannel(RingReader.attach(attach.outputs), EngineOutputs)
        # Whatever an earlier process of this index left in the engine is aborted.
        await requests.send_async(ClientStart())
        self._fit_max_model_len(attach.num_kv_blocks)
        self.supervisors = []
        return requests, outputs, []

    def api_server_attach(self, index: int) -> APIServerAttach:
        """How API server process `index` (1..api_server_count-1) joins this engine.
        Raises ValueError for an index out of range or before start()."""
        if not 1 <= index < self.api_server_count or not self._started:
            raise ValueError(f"no API server {index} (api_server_count "
                             f"{self.api_server_count}, started {self._started})")
        rings = self.supervisor.rings
        return APIServerAttach(index, rings.client_requests[index - 1],
                               rings.client_outputs[index - 1], self.supervisor.generation,
                               self._startup_num_kv_blocks, self.supervisor.run_id,
                               self.api_server_count)

    async def _resubmit_own(self) -> None:
        """API server >= 1: the engine restarted; recompute this frontend's requests."""
        resubmitted = self.detokenizer.processor.resubmit_requests()
        for msg in resubmitted:
            await self.requests.send_async(msg)
        logger.warning("engine generation %d: resubmitted %d in-flight requests",
                       self.detokenizer.generation, len(resubmitted))

    async def _start_inproc(self) -> tuple[Channel, Channel, list[Any]]:
        from flowengine.actors.executor import ExecutorActor
        from flowengine.actors.scheduler import SchedulerActor
        from flowengine.engine import step_trace
        from flowengine.engine.builder import build_engine_core

        step_trace.start("inproc")  # FLOWENGINE_STEP_TRACE: this process's file at exit
        factory = self._core_factory or build_engine_core
        core = await anyio.to_thread.run_sync(factory, self.resolved)
        self.core = core
        self._fit_max_model_len(core.scheduler.num_total_blocks)
        requests, steps, results, outputs = (InprocChannel() for _ in range(4))
        executor = ExecutorActor(core.executor, steps, results)
        scheduler = SchedulerActor(
            core, requests, steps, results, outputs,
            max_steps_in_flight=2 if self.args.async_scheduling else 1,
        )
        self._scheduler_actor = scheduler
        self.engine_actors = {"scheduler": scheduler, "executor": executor}
        return requests, outputs, [scheduler, executor]

    async def _start_data_parallel(self) -> tuple[Any, Any, list[Any]]:
        """N replicas (engine groups) behind one router (flowengine/engine/dp_client.py)."""
        from flowengine.actors.supervisor import Supervisor
        from flowengine.engine.dp_client import (
            DPRequests,
            MergedOutputs,
            ReplicaOutputs,
            ReplicaWatcher,
        )
        from flowengine.engine.dp_router import DPRouter

        n = self.args.data_parallel_size
        self.router = DPRouter(n, self.args.block_size,
                               max_prefix_blocks=8 if self.args.enable_prefix_caching else 0)
        inbox = MergedOutputs()  # what the Detokenizer reads: every replica's outputs
        self.replica_outputs = [ReplicaOutputs(i, None, self.router, inbox) for i in range(n)]
        self.supervisors = [
            Supervisor(
                self.resolved,
                expect_generation=self.replica_outputs[i].expect_generation,
                resubmit=lambda i=i: self._resubmit_replica(i),
                has_work=lambda i=i: self.router.replicas[i].num_unfinished > 0,
                dp_rank=i,
            )
            for i in range(n)
        ]
        self.supervisor = self.supervisors[0]
        started = await asyncio.gather(*(s.start() for s in self.supervisors),
                                       return_exceptions=True)
        errors = [r for r in started if isinstance(r, BaseException)]
        if errors:
            for sup in self.supervisors:
                await sup.stop(timeout_s=0.0)
            raise errors[0]
        blocks = [r.stats.num_total_blocks for r in started if r.stats is not None]
        if blocks:
            self._fit_max_model_len(min(blocks))  # a prompt must fit on any replica
        gates = []
        for sup, outs in zip(self.supervisors, self.replica_outputs, strict=True):
            outs.outputs = sup.outputs
            gates.append(sup.requests)
        requests = DPRequests(self.router, gates)
        self.replica_watchers = [
            ReplicaWatcher(i, sup, self.replica_outputs[i], self.router, requests,
                           self._live_requests)
            for i, sup in enumerate(self.supervisors)
        ]
        return requests, inbox, [*self.replica_outputs, *self.replica_watchers]

    def _live_requests(self) -> list[Any]:
        return self.detokenizer.processor.resubmit_requests()

    def _resubmit_replica(self, replica: int) -> list[Any]:
        """Replica `replica` restarted: recompute the live requests it holds."""
        return [m for m in self._live_requests() if self.router.owner(m.request_id) == replica]

    def _fit_max_model_len(self, num_kv_blocks: int) -> None:
        """Apply the KV-cache fit (`builder.fit_max_model_len`) to the frontend's limits,
        so a prompt the KV cache cannot hold is refused with a ValueError (HTTP 400)."""
        from dataclasses import replace

        from flowengine.engine.builder import fit_max_model_len

        self._startup_num_kv_blocks = num_kv_blocks
        max_model_len = fit_max_model_len(self.resolved, num_kv_blocks)
        if max_model_len != self.resolved.max_model_len:
            self.resolved = replace(self.resolved, max_model_len=max_model_len)
            self.max_model_len = max_model_len

    def _has_unfinished_requests(self) -> bool:
        """Whether the engine has work: this frontend's requests, or (several API server
        processes) any the engine reported running or waiting."""
        detokenizer = getattr(self, "detokenizer", None)  # None until start() built it
        if detokenizer is None:
            return False
        if len(detokenizer.processor) > 0:
            return True
        st = detokenizer.stats
        several = self.api_server_count > 1 or self._attach is not None
        return several and st.num_running + st.num_waiting > 0

    def add_dead_callback(self, callback: Callable[[EngineDeadError], None]) -> None:
        """Call `callback(error)` on this loop when the engine stops by itself (an actor
        failed, or the supervisor gave up restarting), not on `shutdown()`. The server
        uses it to exit non-zero, so a service manager restarts it."""
        self._dead_callbacks.append(callback)

    async def _run(self, actors: list[Any]) -> None:
        try:
            async with anyio.create_task_group() as tg:
                for actor in actors:
                    tg.start_soon(actor.run, name=type(actor).__name__)
        except BaseException as exc:  # an actor failed, or shutdown() cancelled us
            if not self._shutting_down:
                logger.error("engine stopped: %r", exc)
            self._dead = EngineDeadError("the engine was shut down" if self._shutting_down
                                         else f"the engine stopped: {exc!r}")
            self.streamer.fail_all(self._dead)
            if not self._shutting_down:
                for callback in self._dead_callbacks:
                    try:
                        callback(self._dead)
                    except Exception:  # noqa: BLE001 - one bad callback must not hide others
                        logger.exception("engine-dead callback failed")
            if not isinstance(exc, Exception):
                raise

    async def shutdown(self, drain_timeout_s: float = 30.0) -> None:
        """Refuse new requests, let running ones finish (up to the timeout), stop."""
        if not self._started or self._task is None:
            return
        self.ingress.accepting = False
        self._shutting_down = True
        with anyio.move_on_after(drain_timeout_s):
            while len(self.streamer) and self._dead is None:
                await asyncio.sleep(0.02)
        if self._dead is None and self._attach is not None:
            # Not this process's engine to stop: give back what is still running.
            live = [m.request_id for m in self.detokenizer.processor.resubmit_requests()]
            if live:
                await self.requests.send_async(AbortRequest(live))
        elif self._dead is None:
            if self.args.placement != "inproc":
                for sup in self.supervisors:
                    sup.begin_stop()
            await self.requests.send_async(Shutdown())
            with anyio.move_on_after(max(1.0, drain_timeout_s)):
                await self._wait_engine_stopped()
        self._task.cancel()
        with anyio.CancelScope(shield=True):
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        if self.args.placement != "inproc" or self._attach is not None:
            for sup in self.supervisors:
                await sup.stop()
        self._dead = self._dead or EngineDeadError("the engine was shut down")
        self.streamer.fail_all(self._dead)
        if getattr(self, "_shared_stats", None) is not None and self._attach is None:
            # Process 0 stops last (serve() waits for the others): the files go now.
            self._shared_stats.remove_all()
        thaw_heap()  # the stopped engine's cycles become collectable
        restore_gc_threshold(self._gc_threshold)
        self._gc_threshold = None

    async def _wait_engine_stopped(self) -> None:
        if self.args.placement == "inproc":
            # The scheduler actor returns after the drain; the executor after Shutdown.
            await self._scheduler_actor.stopped.wait()
        else:
            for sup, lost in zip(self.supervisors, self._lost_replicas(), strict=True):
                if not lost:
                    await sup.wait_engine_stopped()

    # ------------------------------------------------------------------ requests
    def submit(
        self,
        prompt: str | list[int] | list[dict[str, Any]] | dict[str, Any],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
        output_kind: RequestOutputKind | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield `RequestOutput`s until one has `finished=True`.

        output_kind (vLLM's `RequestOutputKind`, or its int value; TypeError for another
        type, ValueError for another int): what each output holds; None keeps
        `sampling_params.output_kind` (CUMULATIVE by default, as vLLM's AsyncLLM):
        CUMULATIVE → everything so far, DELTA → only what is new since the previous
        output, FINAL_ONLY → one output, the whole result. Outputs a slow caller has not
        taken yet are folded into one (concatenated deltas, or the newest cumulative).

        prompt: text, token ids, {"prompt"|"prompt_token_ids": ..., "cache_salt": ...},
        a conversation (list of messages), or {"messages": [...], "cache_salt": ...,
        "chat_template": ..., "chat_template_kwargs": {...}, "add_generation_prompt":
        bool, "continue_final_message": bool}. sampling_params None: the model's
        defaults from generation_config.json over SamplingParams' (as `LLM` does).

        Raises ValueError/TypeError for bad input (before any output),
        EngineOverloadedError when the queue is full, EngineDeadError if the engine is
        gone. Breaking out of the loop or cancelling aborts the request.
        """
        # A plain function returning the stream itself (no generator around it): closing
        # the caller's loop closes the stream at once, which aborts the request.
        return self._stream(prompt, sampling_params, request_id, priority, None, output_kind)

    async def beam_search(
        self, prompt: str | list[int] | list[dict[str, Any]] | dict[str, Any],
        params: BeamSearchParams, *, priority: int = 0,
    ) -> BeamSearchOutput:
        """Beam search over one prompt (as `submit` takes it); `beam_width` sequences,
        best first, as `LLM.beam_search` returns them (the module function
        `beam_search` documents the errors)."""
        output, _ = await beam_search(self, prompt, params, priority=priority)
        return output

    def encode(
        self,
        prompt: str | list[int] | dict[str, Any],
        pooling_params: PoolingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
    ) -> AsyncIterator[EmbeddingRequestOutput]:
        """Embed one prompt (text, token ids, {"prompt"|"prompt_token_ids": ...}) on a
        pooling-runner model; yields one `EmbeddingRequestOutput` (finished=True), as
        vLLM's `encode`. pooling_params None: the model's defaults.

        Raises ValueError/TypeError for bad input (a generate model, a too long input,
        dimensions the model does not support), EngineOverloadedError and
        EngineDeadError as `submit`. Cancelling aborts the request.
        """
        params = PoolingParams() if pooling_params is None else pooling_params
        return self._stream(prompt, None, request_id, priority, params)  # type: ignore[return-value]

    @property
    def is_pooling(self) -> bool:
        """True when the model serves embeddings (runner "pooling"), not generation."""
        return getattr(self, "resolved", None) is not None and self.resolved.runner == "pooling"

    async def _stream(self, prompt: Any, sampling_params: SamplingParams | None,
                      request_id: str | None, priority: int,
                      pooling_params: PoolingParams | None,
                      output_kind: RequestOutputKind | None = None,
                      ) -> AsyncIterator[RequestOutput]:
        await self.start()
        if self._dead is not None:
            raise self._dead
        self._last_submit_t = time.monotonic()  # (check_health of API server i >= 1)
        if output_kind is not None and pooling_params is None:
            if not isinstance(output_kind, RequestOutputKind):
                # Its int values too, as SamplingParams(output_kind=...) takes them.
                if isinstance(output_kind, bool) or not isinstance(output_kind, int):
                    raise TypeError("output_kind must be a RequestOutputKind (or its value "
                                    f"0, 1 or 2), not {type(output_kind).__name__}")
                if output_kind not in (0, 1, 2):
                    raise ValueError(f"output_kind must be 0, 1 or 2 (CUMULATIVE, DELTA, "
                                     f"FINAL_ONLY), got {output_kind}")
                output_kind = RequestOutputKind(output_kind)
            if sampling_params is None:  # the model's defaults, as the Tokenizer fills them
                sampling_params = SamplingParams(**self.default_sampling_params)
            if isinstance(sampling_params, SamplingParams):  # else the Tokenizer refuses it
                if sampling_params.output_kind != output_kind:
                    sampling_params = msgspec.structs.replace(sampling_params,
                                                              output_kind=output_kind)
        rid, stream, children = await self.ingress.admit(
            prompt, sampling_params, request_id, priority, pooling_params
        )
        self._children[rid] = children
        try:
            while True:
                # stream.get(), inlined: no coroutine per output (one wakeup per step).
                out = stream.take()
                if out is None:
                    await stream.wait()
                    continue
                yield out
                if out.finished:
                    return
        finally:
            self._children.pop(rid, None)
            if not stream.finished:
                with anyio.CancelScope(shield=True):
                    await self._abort(rid, children, caller_gone=True)

    async def abort(self, request_id: str) -> None:
        """Abort a request by id; its stream ends with finish_reason "abort"."""
        children = self._children.get(request_id)
        if children:
            await self._abort(request_id, children, caller_gone=False)

    async def _abort(self, request_id: str, children: list[str], *, caller_gone: bool) -> None:
        """The one place a request is aborted: the engine frees its children's blocks;
        caller_gone: its stream is closed and the Detokenizer forgets it now (no output
        for it is made any more), else its stream ends with the engine's "abort"."""
        if caller_gone:
            self.streamer.close(request_id)
            self.detokenizer.forget(request_id)
        if self._dead is None:
            await self.requests.send_async(AbortRequest(children))

    def _abort_orphan(self, child_id: str) -> None:
        """An output for a stream that is gone (closed between steps): abort it."""
        if self._dead is None:
            asyncio.get_running_loop().create_task(
                self._abort(child_id, [child_id], caller_gone=False))

    def _resubmit_after_restart(self) -> list[Any]:
        """The engine restarted: recompute every live request from what was delivered."""
        return self.detokenizer.processor.resubmit_requests()

    # ------------------------------------------------------------------ introspection
    def get_tokenizer(self) -> Any:
        return self.tokenizer

    async def check_health(self) -> None:
        """Raise EngineDeadError if the engine cannot serve: it stopped, or (multiproc)
        the step watchdog sees no engine step for FLOWENGINE_STEP_STALL_UNHEALTHY_S
        seconds while requests wait (a hung or stopped process; see Supervisor); with
        data parallelism, when that holds for every live replica."""
        if self._dead is not None:
            raise self._dead
        if self._task is not None and self._task.done():
            raise EngineDeadError("the engine task ended")
        if self._attach is not None:
            # No supervisor here (process 0 has it): the engine sends this process a
            # message every step, so silence while it has work is a stall.
            from flowengine.actors.supervisor import SupervisorLimits

            silent_s = time.monotonic() - max(self.detokenizer.last_output_t,
                                              getattr(self, "_last_submit_t", 0.0))
            limit_s = SupervisorLimits.from_env().stall_unhealthy_s
            if silent_s > limit_s and self._has_unfinished_requests():
                raise EngineDeadError(
                    f"the engine is stalled: no engine step for {silent_s:.1f} s while "
                    f"requests wait (limit {limit_s:g} s, FLOWENGINE_STEP_STALL_UNHEALTHY_S)")
        # Data parallel: unhealthy only when no live replica can serve (new requests
        # avoid a restarting replica; a hung one is restarted by its watchdog).
        reasons = [
            sup.unhealthy_reason()
            for sup, lost in zip(getattr(self, "supervisors", []), self._lost_replicas(),
                                 strict=True)
            if not lost
        ]
        if reasons and all(r is not None for r in reasons):
            if len(reasons) == 1:
                raise EngineDeadError(f"the engine is stalled: {reasons[0]}")
            raise EngineDeadError("every data-parallel replica is stalled: " + "; ".join(
                f"replica {i}: {r}" for i, r in enumerate(reasons)))

    def _lost_replicas(self) -> list[bool]:
        """Per supervisor: True when that data-parallel replica is down for good."""
        watchers = getattr(self, "replica_watchers", None)
        if watchers is None:
            return [False] * len(getattr(self, "supervisors", []))
        return [w.is_lost for w in watchers]

    def get_stats(self) -> EngineStats:
        """The engine's gauges and counters and this frontend's request statistics;
        with several API server processes, their request statistics summed
        (flowengine/engine/frontend_stats.py)."""
        stats = self._local_stats()
        shared = getattr(self, "_shared_stats", None)
        if shared is None:
            return stats
        return shared.total(stats)

    def _local_stats(self) -> EngineStats:
        replicas = getattr(self, "replica_outputs", None)
        if replicas is not None:
            return self._data_parallel_stats(replicas)
        st = self.detokenizer.stats
        if st.num_total_blocks:
            num_total_blocks, num_free_blocks = st.num_total_blocks, st.num_free_blocks
        else:  # no stats message yet: the start-up count, all free
            num_total_blocks = num_free_blocks = self._startup_num_kv_blocks
        return EngineStats(
            num_running=st.num_running,
            num_waiting=st.num_waiting,
            kv_cache_usage=st.kv_cache_usage,
            num_free_blocks=num_free_blocks,
            num_total_blocks=num_total_blocks,
            # vLLM's meaning: prefill tokens computed (prefix-cache hits excluded).
            prompt_tokens_total=self.detokenizer.request_stats.prompt_tokens_computed_total,
            generation_tokens_total=self.detokenizer.generation_tokens_total,
            num_preemptions_total=st.num_preemptions_total,
            prefix_cache_queries_total=st.prefix_cache_queries_total,
            prefix_cache_hits_total=st.prefix_cache_hits_total,
            spec_decode_num_drafts_total=st.spec_decode_num_drafts_total,
            spec_decode_num_draft_tokens_total=st.spec_decode_num_draft_tokens_total,
            spec_decode_num_accepted_tokens_total=st.spec_decode_num_accepted_tokens_total,
            spec_decode_num_accepted_tokens_per_pos=list(
                st.spec_decode_num_accepted_tokens_per_pos),
            finished_by_reason=dict(self.detokenizer.finished_by_reason),
            histograms=self.detokenizer.request_stats.snapshot(),
            cache_config=self._cache_config(num_total_blocks),
        )

    def _data_parallel_stats(self, replicas: list[Any]) -> EngineStats:
        """Totals over the replicas, and each replica's own in `per_engine` (its
        scheduler's gauges and counters, and the tokens it generated)."""
        per_engine = [
            EngineStats(
                num_running=r.stats.num_running, num_waiting=r.stats.num_waiting,
                kv_cache_usage=r.stats.kv_cache_usage,
                num_free_blocks=r.stats.num_free_blocks,
                num_total_blocks=r.stats.num_total_blocks,
                generation_tokens_total=r.generation_tokens_total,
                num_preemptions_total=r.stats.num_preemptions_total,
                prefix_cache_queries_total=r.stats.prefix_cache_queries_total,
                prefix_cache_hits_total=r.stats.prefix_cache_hits_total,
                cache_config=self._cache_config(r.stats.num_total_blocks),
            )
            for r in replicas
        ]
        total_blocks = sum(e.num_total_blocks for e in per_engine)
        free_blocks = sum(e.num_free_blocks for e in per_engine)
        return EngineStats(
            num_running=sum(e.num_running for e in per_engine),
            num_waiting=sum(e.num_waiting for e in per_engine),
            kv_cache_usage=(total_blocks - free_blocks) / total_blocks if total_blocks else 0.0,
            num_free_blocks=free_blocks,
            num_total_blocks=total_blocks,
            prompt_tokens_total=self.detokenizer.request_stats.prompt_tokens_computed_total,
            generation_tokens_total=self.detokenizer.generation_tokens_total,
            num_preemptions_total=sum(e.num_preemptions_total for e in per_engine),
            prefix_cache_queries_total=sum(e.prefix_cache_queries_total for e in per_engine),
            prefix_cache_hits_total=sum(e.prefix_cache_hits_total for e in per_engine),
            finished_by_reason=dict(self.detokenizer.finished_by_reason),
            histograms=self.detokenizer.request_stats.snapshot(),
            cache_config=self._cache_config(total_blocks),
            spec_decode_num_drafts_total=sum(
                r.stats.spec_decode_num_drafts_total for r in replicas),
            spec_decode_num_draft_tokens_total=sum(
                r.stats.spec_decode_num_draft_tokens_total for r in replicas),
            spec_decode_num_accepted_tokens_total=sum(
                r.stats.spec_decode_num_accepted_tokens_total for r in replicas),
            spec_decode_num_accepted_tokens_per_pos=[
                sum(col) for col in itertools.zip_longest(
                    *(r.stats.spec_decode_num_accepted_tokens_per_pos for r in replicas),
                    fillvalue=0)],
            per_engine=per_engine,
        )

    def _cache_config(self, num_blocks: int) -> dict[str, str]:
        """cache_config_info's labels (vLLM's CacheConfig names), values as strings."""
        args = self.args
        return {
            "block_size": str(args.block_size),
            "cache_dtype": args.kv_cache_dtype,
            "enable_prefix_caching": str(args.enable_prefix_caching),
            "gpu_memory_utilization": str(args.gpu_memory_utilization),
            "num_gpu_blocks": str(num_blocks),
            "num_gpu_blocks_override": str(args.num_kv_blocks),
        }


class _StatsPublisher:
    """Publishes this API server process's request statistics about once a second
    (`SharedFrontendStats.publish`), for the others' /metrics and stats line."""

    def __init__(self, shared: Any, get_stats: Callable[[], EngineStats]) -> None:
        self.shared = shared
        self.get_stats = get_stats

    async def run(self) -> None:
        from flowengine.engine.frontend_stats import PUBLISH_INTERVAL_S

        while True:
            try:
                self.shared.publish(self.get_stats())
            except OSError as err:  # /dev/shm full or gone: the others miss our share
                logger.warning("could not publish this process's request stats: %s", err)
            await asyncio.sleep(PUBLISH_INTERVAL_S)
