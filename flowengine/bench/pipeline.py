"""`flowengine bench pipeline`: the actor pipeline's own ceiling, with a null model.

    flowengine bench pipeline --num-streams 1000 --output-len 64

A null executor emits one token per running request per step instantly (no model),
so the figure is what the pipeline (ingress and tokenizer, called in each caller's
task; the scheduler actor; the executor actor with its resolver; the detokenizer
actor, which calls the streamer) and 1,000 concurrent `submit()` callers can deliver:
tokens/s received by the callers, with the busy time of each stage. Placement is
inproc: every actor in this one process, sharing its core with the callers.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import shlex
import time
from typing import Any

from flowengine.executor.executor import CompletedStep
from flowengine.messages import SampledTokens, StepPlan, StepResult


class _SingleRank:
    """A tensor-parallel group of one rank (the executor actor reads `runner.tp`)."""

    rank = 0
    world_size = 1


class NullModelExecutor:
    """Stands in for model runner + sampler (`flowengine.executor.Executor`): every
    request that would sample gets one token, at once. Tracks token counts from the
    plans like a real executor does; `launch` returns a completed handle, as a runner
    that computes the step before returning does."""

    def __init__(self, vocab_ids: list[int]) -> None:
        self.runner = self
        self.tp = _SingleRank()
        self._num_tokens: dict[str, int] = {}
        self._vocab = vocab_ids
        self._i = 0

    def forward(self, plan: StepPlan) -> list[str]:
        """The requests of `plan` that sample (their tokens reach the last known one)."""
        for rid in plan.finished_req_ids:
            self._num_tokens.pop(rid, None)
        for r in plan.new_reqs:
            self._num_tokens[r.req_id] = len(r.token_ids)
        sampling = []
        computed = {r.req_id: r.num_computed_tokens for r in plan.new_reqs}
        computed.update({r.req_id: r.num_computed_tokens for r in plan.cached_reqs})
        for rid, n in zip(plan.scheduled_req_ids, plan.num_scheduled_tokens, strict=True):
            if computed[rid] + n >= self._num_tokens[rid]:
                sampling.append(rid)
        return sampling

    def launch(self, plan: StepPlan) -> CompletedStep:
        return CompletedStep(self.sample(plan, self.forward(plan)))

    def execute_model(self, plan: StepPlan) -> StepResult:
        return self.sample(plan, self.forward(plan))

    def sample(self, plan: StepPlan, req_ids: list[str]) -> StepResult:
        out = []
        for rid in req_ids:
            self._i = (self._i + 1) % len(self._vocab)
            self._num_tokens[rid] += 1
            out.append(SampledTokens(rid, [self._vocab[self._i]]))
        return StepResult(plan.step_id, out)


def null_core_factory(resolved: Any) -> Any:
    from flowengine.engine.builder import build_scheduler
    from flowengine.engine.engine_core import EngineCore

    scheduler = build_scheduler(resolved, num_blocks=1 << 16)
    vocab = list(range(1000, 1256))  # ordinary word pieces of the tokenizer
    return EngineCore(scheduler, NullModelExecutor(vocab), resolved.max_model_len)


async def _inline(fn: Any, *args: Any) -> Any:
    return fn(*args)


async def run(num_streams: int, input_len: int, output_len: int, args: dict) -> dict:
    from flowengine.entrypoints.async_engine import AsyncEngine
    from flowengine.sampling_params import RequestOutputKind, SamplingParams

    engine = AsyncEngine(core_factory=null_core_factory, max_queue_len=num_streams + 1, **args)
    await engine.start()
    # No worker threads for a null model: launch inline (its handles are complete).
    engine.engine_actors["executor"]._blocking = _inline
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    prompt = list(range(2000, 2000 + input_len))
    consumer_s = 0.0

    async def one() -> int:
        nonlocal consumer_s
        n = 0
        async for out in engine.submit(prompt, params, output_kind=RequestOutputKind.DELTA):
            t = time.perf_counter()
            n += len(out.outputs[0].token_ids)
            consumer_s += time.perf_counter() - t
        return n

    gc_runs = [0, 0.0]  # collections during the run, seconds in them
    gc_start = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_start[0] = time.perf_counter()
        else:
            gc_runs[0] += 1
            gc_runs[1] += time.perf_counter() - gc_start[0]

    gc.callbacks.append(on_gc)
    start, cpu_start = time.perf_counter(), time.process_time()
    try:
        counts = await asyncio.gather(*(one() for _ in range(num_streams)))
    finally:
        gc.callbacks.remove(on_gc)
    # CPU time of the process over the run: on a loaded machine it varies less than
    # the wall time (which includes time other processes hold the cores).
    elapsed, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    busy = {name: a.busy_s for name, a in engine.engine_actors.items()}
    busy["executor (resolver)"] = engine.engine_actors["executor"].resolve_s
    busy["tokenizer"] = engine.tokenizer_actor.busy_s
    busy["detokenizer"] = engine.detokenizer.busy_s
    busy["streamer"] = engine.streamer.busy_s
    busy["callers (async for)"] = consumer_s
    timers = engine.engine_actors["executor"].timers()
    await engine.shutdown(drain_timeout_s=5)
    return {"tokens": sum(counts), "elapsed_s": elapsed, "busy_s": busy, "cpu_s": cpu_s,
            "gc_collections": gc_runs[0], "gc_s": gc_runs[1], "timers": timers}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="flowengine bench pipeline", description=__doc__)
    p.add_argument("--num-streams", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--model", default=None, help="model whose tokenizer is used (default SmolLM2)")
    p.add_argument("--async-scheduling", action="store_true")
    ns = p.parse_args(argv)
    args = {"model": ns.model, "max_num_seqs": ns.num_streams,
            "max_num_batched_tokens": max(8192, ns.num_streams * ns.input_len),
            "async_scheduling": ns.async_scheduling}
    from flowengine.actors.procs import new_event_loop_factory

    with asyncio.Runner(loop_factory=new_event_loop_factory()) as runner:  # uvloop
        res = runner.run(run(ns.num_streams, ns.input_len, ns.output_len, args))
    tok_s = res["tokens"] / res["elapsed_s"]
    print(f"\ncommand: flowengine bench pipeline {shlex.join(argv)}")
    print(f"{ns.num_streams} concurrent submit() streams x {ns.output_len} tokens, null model\n")
    print("| tokens delivered | elapsed s | tokens/s | process CPU us per token | "
          "GC collections (s) |")
    print("|---|---|---|---|---|")
    print(f"| {res['tokens']} | {res['elapsed_s']:.2f} | {tok_s:,.0f} | "
          f"{1e6 * res['cpu_s'] / max(res['tokens'], 1):.1f} | "
          f"{res['gc_collections']} ({res['gc_s']:.3f}) |")
    print("\n| actor | busy s | share of wall | us per token |")
    print("|---|---|---|---|")
    for name, b in res["busy_s"].items():
        print(f"| {name} | {b:.2f} | {b / res['elapsed_s']:.0%} | "
              f"{1e6 * b / max(res['tokens'], 1):.1f} |")
    rest = res["elapsed_s"] - sum(res["busy_s"].values())
    print(f"| event loop, queues, tasks (rest) | {rest:.2f} | {rest / res['elapsed_s']:.0%} | "
          f"{1e6 * rest / max(res['tokens'], 1):.1f} |")
    print("\nexecutor timers: " + " ".join(f"{k}={v:.4g}" for k, v in res["timers"].items()))
    return 0
