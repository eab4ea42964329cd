"""Structured outputs: throughput and TPOT with a JSON-schema constraint against the
same workload unconstrained, and grammar compile times (issue 13).

    python benchmarks/structured_outputs.py [--batch-sizes 1 32] [--output-len 48]
        [--reps 2] [--device cpu] [--async-scheduling] [--model DIR --load-format dummy]
    python benchmarks/structured_outputs.py --write-model-dir DIR   # the H200 model

Workload: the default model (SmolLM2-135M-Instruct) unless --model, `batch` copies of
one short chat prompt, exactly `output_len` tokens each, temperature 1.0. Constrained:
a JSON schema (an array of at least 40 records) whose every output is longer than
output_len, so each request is cut by max_tokens at the same length as the
unconstrained run (ignore_eos). Runs of the two alternate `reps` times per batch size
(free then JSON, then JSON then free, ...: neither always goes second); the table gives
the medians.

Engines: by default the offline `LLM` (one step at a time; TPOT = mean duration of
the decode steps, every step after the first, which prefills the batch). With
--async-scheduling, the served path: `AsyncEngine` (in-process, or `--placement multiproc`:
scheduler and executor in their own processes) with two steps in flight,
where a constrained step's forward is launched before its bitmask is filled (docs/
design.md, "Structured outputs"); `--engine async` without --async-scheduling: the same
engine with one step in flight (what `flowengine serve` runs on the CPU). There TPOT = mean over requests of (last token time - first
token time) / (tokens - 1), as vLLM's benchmarks define it. mask = the CPU time the
scheduler spent filling bitmasks, per step. Then the compile time of each of the 30
schemas of tests/data/json_schemas.json on a fresh backend (no cache), xgrammar or
llguidance as "auto" picks. Prints markdown tables last, with the load average.

--fill-only measures the scheduler's per-step grammar work alone, on the host: N
requests under the JSON schema above (xgrammar), each step's bitmask filled for all N
rows and one allowed token (random) accepted per row, for 48 steps; "row by row" is
the fill before the batched one (one xgrammar call per row into a fresh tensor, as
bytes), checked equal to the batched fill at every step; median ms per step.

    python benchmarks/structured_outputs.py --fill-only [--rows 32 128] [--threads 1 2]

--write-model-dir DIR writes the H200 benchmark's model: Llama-3.1-8B's shapes with
SmolLM2's vocabulary (49,152 tokens) and its tokenizer files and chat template, no
weights (run it with --load-format dummy: random bf16 weights built on the device).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from flowengine import LLM, SamplingParams, StructuredOutputsParams
from flowengine.sampling_params import RequestOutputKind
from flowengine.structured_outputs.backend import GrammarOptions, select_backend

ROOT = Path(__file__).resolve().parents[1]
RECORD = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 9999},
    "name": {"type": "string", "minLength": 3, "maxLength": 12},
    "active": {"type": "boolean"}},
    "required": ["id", "name", "active"], "additionalProperties": False}
SCHEMA = {"type": "array", "items": RECORD, "minItems": 40}


def _timed_steps(llm: LLM) -> tuple[list[float], list[float]]:
    """Wrap the engine core's step and the scheduler's bitmask fill with timers."""
    core = llm.engine
    steps: list[float] = []
    masks: list[float] = []
    step = core.step

    def timed_step():
        t = time.perf_counter()
        out = step()
        steps.append(time.perf_counter() - t)
        return out

    core.step = timed_step
    manager = core.scheduler.structured_outputs
    fill = manager.fill_bitmask

    def timed_fill(req_ids):
        t = time.perf_counter()
        out = fill(req_ids)
        masks.append(time.perf_counter() - t)
        return out

    manager.fill_bitmask = timed_fill
    return steps, masks


class StageTimers:
    """--stage-timers: wall time of each part of a step, summed per run (in-process
    engines; the CPU runner's forward): schedule, forward, the bitmask fill, the mask's
    application, the sampler, update (the scheduler's update_from_output, the matchers'
    advance included), accept (that advance alone), and the step as a whole."""

    PARTS = ("step", "schedule", "forward", "fill", "apply", "sampler", "update", "accept")

    def __init__(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(self.PARTS, 0.0)

    def wrap(self, obj, name: str, part: str) -> None:
        inner = getattr(obj, name)
        seconds = self.seconds

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                seconds[part] += time.perf_counter() - t

        setattr(obj, name, timed)

    def install(self, core, executor) -> None:
        import flowengine.executor.executor as executor_module

        manager = core.scheduler.structured_outputs
        if executor is not None:
            self.wrap(executor.runner, "execute_model", "forward")
            self.wrap(executor, "sampler", "sampler")  # an attribute: called per step
        self.wrap(executor_module, "apply_plan_bitmask", "apply")
        self.wrap(core, "schedule", "schedule")
        self.wrap(core.scheduler, "update_from_output", "update")
        self.wrap(manager, "fill_bitmask", "fill")
        self.wrap(manager, "accept_tokens_batch", "accept")

    def take(self, num_steps: int) -> dict[str, float]:
        """ms per step of each part since the last take."""
        out = {f"{k}_ms": 1e3 * v / max(num_steps, 1) for k, v in self.seconds.items()}
        for k in self.seconds:  # in place: the wrappers hold this dict
            self.seconds[k] = 0.0
        return out


def run_once(llm: LLM, prompt: str, batch: int, output_len: int, constrained: bool,
             steps: list[float], masks: list[float],
             stages: StageTimers | None = None) -> dict[str, float]:
    params = _params(output_len, constrained)
    steps.clear()
    masks.clear()
    t = time.perf_counter()
    outs = llm.generate([prompt] * batch, params, use_tqdm=False)
    wall = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == batch * output_len, (tokens, batch * output_len)
    if constrained:
        assert all(o.outputs[0].finish_reason == "length" for o in outs)
    decode = steps[1:]
    out = {"tok_s": tokens / wall, "tpot_ms": 1e3 * statistics.mean(decode),
           "mask_ms": 1e3 * sum(masks) / max(len(decode), 1)}
    if stages is not None:
        stages.seconds["step"] = sum(steps)
        out.update(stages.take(len(steps)))
    return out


# Llama-3.1-8B's config.json (meta-llama/Llama-3.1-8B) architecture fields, with
# SmolLM2's vocabulary and special tokens (its tokenizer is what the grammars index).
LLAMA_31_8B_SMOLLM2_VOCAB = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    "hidden_act": "silu", "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "generation_config.json")


def write_model_dir(path: str) -> None:
    """The H200 model: LLAMA_31_8B_SMOLLM2_VOCAB's config.json and the default model's
    tokenizer files (no weights: load with load_format "dummy")."""
    from flowengine.config import EngineArgs
    from flowengine.engine.builder import resolve

    source = resolve(EngineArgs()).model_path
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(LLAMA_31_8B_SMOLLM2_VOCAB, f, indent=1)
    for name in TOKENIZER_FILES:
        if os.path.exists(os.path.join(source, name)):
            shutil.copy(os.path.join(source, name), os.path.join(path, name))


def _params(output_len: int, constrained: bool) -> SamplingParams:
    so = StructuredOutputsParams(json=SCHEMA) if constrained else None
    return SamplingParams(temperature=1.0, max_tokens=output_len, ignore_eos=not constrained,
                          seed=1, structured_outputs=so)


async def run_async_once(engine, prompt: str, batch: int, output_len: int, constrained: bool,
                         masks: list[float]) -> dict[str, float]:
    """One batch through `AsyncEngine.submit` (two steps in flight; DELTA outputs, each
    with the new tokens only): tok/s over the wall time, TPOT from each request's token
    arrival times."""
    params = _params(output_len, constrained)
    masks.clear()
    core = getattr(engine, "core", None)  # None in the multiproc placement
    steps_before = core.num_steps if core is not None else 0

    async def one() -> tuple[int, float, float]:
        n, first, last = 0, 0.0, 0.0
        async for out in engine.submit(prompt, params, output_kind=RequestOutputKind.DELTA):
            k = len(out.outputs[0].token_ids)
            if k:
                last = time.perf_counter()
                first = first or last
                n += k
            if out.finished:
                assert out.outputs[0].finish_reason == "length", out.outputs[0].finish_reason
        return n, first, last

    t = time.perf_counter()
    runs = await asyncio.gather(*(one() for _ in range(batch)))
    wall = time.perf_counter() - t
    tokens = sum(n for n, _, _ in runs)
    assert tokens == batch * output_len, (tokens, batch * output_len)
    num_steps = max(core.num_steps - steps_before, 1) if core is not None else 1
    return {"tok_s": tokens / wall,
            "tpot_ms": 1e3 * statistics.mean((b - a) / (n - 1) for n, a, b in runs),
            # mean time to the first token over the batch, from the batch's submission
            "ttft_ms": 1e3 * statistics.mean(a - t for _, a, _ in runs),
            # the scheduler's process is not this one in the multiproc placement
            "mask_ms": 1e3 * sum(masks) / num_steps if core is not None else float("nan")}


def compile_times(tokenizer, vocab_size: int) -> list[tuple[str, str, float]]:
    from flowengine.structured_outputs.guidance_backend import GuidanceBackend
    from flowengine.structured_outputs.xgrammar_backend import XgrammarBackend

    schemas = json.loads((ROOT / "tests" / "data" / "json_schemas.json").read_text())["schemas"]
    rows = []
    for name, schema in schemas.items():
        so = StructuredOutputsParams(json=schema)
        backend_name = select_backend("auto", so.kind, so.spec)
        # A fresh backend per schema: nothing cached (xgrammar caches compiled grammars).
        backend = (XgrammarBackend(tokenizer, vocab_size) if backend_name == "xgrammar"
                   else GuidanceBackend(tokenizer, vocab_size,
                                        eos_token_id=tokenizer.eos_token_id))
        t = time.perf_counter()
        backend.compile(so.kind, so.spec, GrammarOptions())
        rows.append((name, backend_name, 1e3 * (time.perf_counter() - t)))
    return rows


def _fill_row_by_row(manager, request_ids: list[str]) -> bytes:
    """The fill before the batched one: a fresh tensor, one xgrammar call per row (its
    Python wrapper converts the tensor each time), then bytes."""
    import torch

    bitmask = torch.full((len(request_ids), manager.num_words), -1, dtype=torch.int32)
    for row, rid in enumerate(request_ids):
        manager._matchers[rid]._m.fill_next_token_bitmask(bitmask, row)
    return bitmask.numpy().tobytes()


def fill_benchmark(tokenizer, vocab_size: int, rows_list: list[int], threads_list: list[int],
                   num_steps: int = 48) -> list[tuple[int, str, float, float]]:
    """(rows, variant, fill ms/step, accept ms/step) medians; see the module docstring."""
    import random

    import numpy as np

    from flowengine.request import Request
    from flowengine.structured_outputs.manager import StructuredOutputManager

    out = []
    rng = random.Random(0)
    for num_rows in rows_list:
        managers = {t: StructuredOutputManager("xgrammar", vocab_size=vocab_size,
                                               tokenizer=tokenizer, fill_threads=t)
                    for t in threads_list}
        ids = [f"r{i}" for i in range(num_rows)]
        for manager in managers.values():
            for rid in ids:
                req = Request(rid, [1], SamplingParams(
                    max_tokens=num_steps, structured_outputs=StructuredOutputsParams(
                        json=SCHEMA)), eos_token_id=tokenizer.eos_token_id,
                    max_tokens=num_steps)
                manager.add_request(req)
                while manager.poll(req) == "compiling":
                    manager.wait_for_compiles(5.0)
        times: dict[str, list[float]] = {}
        accepts: list[float] = []
        accepts_before: list[float] = []
        for _ in range(num_steps):
            first = next(iter(managers.values()))
            t = time.perf_counter()
            reference = _fill_row_by_row(first, ids)
            times.setdefault("row by row", []).append(time.perf_counter() - t)
            for threads, manager in managers.items():
                t = time.perf_counter()
                got = manager.fill_bitmask(ids)
                times.setdefault(f"batched, {threads} thread(s)", []).append(
                    time.perf_counter() - t)
                assert got == reference, "batched fill differs from row by row"
            words = np.frombuffer(reference, dtype=np.uint32).reshape(num_rows, -1)
            bits = np.unpackbits(words.view(np.uint8), bitorder="little").reshape(num_rows, -1)
            tokens = [rng.choice(np.flatnonzero(bits[i, :vocab_size]).tolist())
                      for i in range(num_rows)]
            for i, manager in enumerate(managers.values()):
                t = time.perf_counter()
                if i == 0:  # the accepts before: xgrammar's wrapper, is_terminated first
                    for rid, tok in zip(ids, tokens, strict=True):
                        matcher = manager._matchers[rid]._m
                        assert not matcher.is_terminated() and matcher.accept_token(tok)
                    accepts_before.append(time.perf_counter() - t)
                    manager._dirty.update(ids)
                    continue
                # What the scheduler calls: one batched call per step.
                assert all(manager.accept_tokens_batch(
                    [(rid, [tok]) for rid, tok in zip(ids, tokens, strict=True)]))
                accepts.append(time.perf_counter() - t)
        for variant, ts in times.items():
            before = variant == "row by row"
            out.append((num_rows, variant, 1e3 * statistics.median(ts),
                        1e3 * statistics.median(accepts_before if before else accepts)))
        for manager in managers.values():
            manager.shutdown()
    return out


def _main_fill(args) -> None:
    from flowengine.config import EngineArgs
    from flowengine.engine.builder import resolve
    from flowengine.model.model_config import ModelConfig
    from flowengine.tokenize.tokenizer import load_tokenizer

    path = args.model or resolve(EngineArgs()).model_path
    tokenizer = load_tokenizer(path)
    vocab_size = ModelConfig.from_pretrained(path).vocab_size
    load_before = os.getloadavg()
    rows = fill_benchmark(tokenizer, vocab_size, args.rows, args.threads)
    load_after = os.getloadavg()
    print(f"\ncommand: python benchmarks/structured_outputs.py {' '.join(sys.argv[1:])}\n"
          f"host bitmask work per step, JSON schema, xgrammar; load average before "
          f"{load_before[0]:.2f}, after {load_after[0]:.2f} ({os.cpu_count()} CPUs); "
          "medians of 48 steps\n")
    print("| rows | fill (and accept) | fill ms/step | accept ms/step |")
    print("|---|---|---|---|")
    for num_rows, variant, fill_ms, accept_ms in rows:
        print(f"| {num_rows} | {variant} | {fill_ms:.3f} | {accept_ms:.3f} |")


def _timed_fill(manager, masks: list[float]) -> None:
    fill = manager.fill_bitmask

    def timed_fill(req_ids):
        t = time.perf_counter()
        out = fill(req_ids)
        masks.append(time.perf_counter() - t)
        return out

    manager.fill_bitmask = timed_fill


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="AsyncEngine with two steps in flight")
    parser.add_argument("--engine", choices=("llm", "async"), default="llm",
                        help="llm: the offline LLM, one step at a time; async: AsyncEngine "
                        "(implied by --async-scheduling; without it one step in flight, the "
                        "CPU server's default)")
    parser.add_argument("--placement", choices=("inproc", "multiproc"), default="inproc",
                        help="with the AsyncEngine: its placement (multiproc: "
                        "the scheduler and the executor in processes of their own, so the "
                        "matchers' advance and fill do not share the executor's GIL; no mask "
                        "column)")
    parser.add_argument("--write-model-dir", default=None, metavar="DIR")
    parser.add_argument("--json-out", default=None, help="write the raw runs here")
    parser.add_argument("--no-compile-times", action="store_true",
                        help="skip the 30 schemas' compile times after the runs")
    parser.add_argument("--stage-timers", action="store_true",
                        help="LLM engine: time each part of a step (schedule, forward, fill, "
                        "apply, sampler, update, accept) and print a table of them")
    parser.add_argument("--inline-variant", action="store_true",
                        help="with --async-scheduling --placement inproc: a third variant, "
                        "JSON with the grammar work on the scheduler's loop (no worker "
                        "thread: grammar_offload_rows None)")
    parser.add_argument("--fill-only", action="store_true",
                        help="time the host's per-step bitmask fill and accepts alone")
    parser.add_argument("--rows", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    if args.write_model_dir is not None:
        write_model_dir(args.write_model_dir)
        return
    if args.fill_only:
        _main_fill(args)
        return
    if args.async_scheduling or args.engine == "async":
        asyncio.run(_main(args))
    else:
        _main_llm(args)


def _engine_args(args) -> dict:
    return {"model": args.model, "device": args.device, "load_format": args.load_format,
            "max_num_seqs": max(args.batch_sizes), "max_model_len": 1024, "seed": 0}


def _chat_prompt(tokenizer) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": "List some user records as JSON."}], tokenize=False,
        add_generation_prompt=True)


def _order(rep: int) -> tuple[bool, bool]:
    """(constrained?) of repetition `rep`'s two runs: free first on even repetitions,
    JSON first on odd ones, so neither always runs second (under a load that rises
    during the runs, the second of a pair is the slower)."""
    return (False, True) if rep % 2 == 0 else (True, False)


def _main_llm(args) -> None:
    llm = LLM(**_engine_args(args), placement="inproc")  # its steps are timed in process
    tokenizer = llm.input_processor.tokenizer
    prompt = _chat_prompt(tokenizer)
    steps, masks = _timed_steps(llm)
    stages = None
    if args.stage_timers:
        stages = StageTimers()
        stages.install(llm.engine, llm.engine.executor)
    run_once(llm, prompt, 1, 4, True, steps, masks, stages)  # warm-up: tokenizer info, compile
    load_before = os.getloadavg()
    results: dict[tuple[int, str], list[dict[str, float]]] = {}
    for batch in args.batch_sizes:
        for rep in range(args.reps):
            for constrained in _order(rep):
                r = run_once(llm, prompt, batch, args.output_len, constrained, steps, masks,
                             stages)
                variant = "json" if constrained else "free"
                results.setdefault((batch, variant), []).append(r)
                print(f"batch {batch} {variant}: {r}", flush=True)
    load_after = os.getloadavg()
    _report(args, results, load_before, load_after, tokenizer,
            llm.resolved.model_config.vocab_size, "LLM, one step at a time")
    llm.shutdown()


async def _main(args) -> None:
    from flowengine.entrypoints.async_engine import AsyncEngine

    engine = AsyncEngine(**_engine_args(args), async_scheduling=args.async_scheduling,
                         disable_log_stats=True, placement=args.placement)
    await engine.start()
    try:
        tokenizer = engine.tokenizer
        prompt = _chat_prompt(tokenizer)
        masks: list[float] = []
        if args.placement == "inproc":
            _timed_fill(engine.core.scheduler.structured_outputs, masks)
        await run_async_once(engine, prompt, 1, 4, True, masks)  # warm-up
        await run_async_once(engine, prompt, max(args.batch_sizes), 4, False, masks)
        variants = ["free", "json"]
        scheduler = engine.core.scheduler if args.placement == "inproc" else None
        offload_rows = scheduler.grammar_offload_rows if scheduler is not None else None
        if args.inline_variant and scheduler is not None:
            variants.append("json-inline")
        load_before = os.getloadavg()
        results: dict[tuple[int, str], list[dict[str, float]]] = {}
        for batch in args.batch_sizes:
            for rep in range(args.reps):
                for variant in (variants if rep % 2 == 0 else variants[::-1]):
                    if scheduler is not None:  # json-inline: the grammar work on the loop
                        scheduler.grammar_offload_rows = (
                            None if variant == "json-inline" else offload_rows)
                    r = await run_async_once(engine, prompt, batch, args.output_len,
                                             variant != "free", masks)
                    results.setdefault((batch, variant), []).append(r)
                    print(f"batch {batch} {variant}: {r}", flush=True)
        load_after = os.getloadavg()
        _report(args, results, load_before, load_after, tokenizer,
                engine.resolved.model_config.vocab_size,
                f"AsyncEngine {args.placement}, " + ("async scheduling (2 steps in flight)"
                                                     if args.async_scheduling
                                                     else "one step in flight"))
    finally:
        await engine.shutdown(drain_timeout_s=30)


def _report(args, results, load_before, load_after, tokenizer, vocab_size: int,
            engine_name: str) -> None:
    rows = [] if args.no_compile_times else compile_times(tokenizer, vocab_size)
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "engine": engine_name,
                       "runs": {f"{b}-{v}": r for (b, v), r in results.items()},
                       "compile_ms": rows, "load": [load_before, load_after]}, f, indent=1)

    def med(batch: int, variant: str, key: str) -> float:
        return statistics.median(r[key] for r in results[(batch, variant)])

    inline = any(v == "json-inline" for _, v in results)
    print(f"\ncommand: python benchmarks/structured_outputs.py "
          f"{' '.join(sys.argv[1:])}\nengine: {engine_name}; device {args.device}; "
          f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} "
          f"({os.cpu_count()} CPUs); {args.reps} alternated runs per cell, medians; "
          f"output {args.output_len} tokens per request\n")
    head = ("| batch | unconstrained tok/s | JSON-schema tok/s | ratio | unconstrained TPOT ms "
            "| JSON-schema TPOT ms | mask fill ms/step |")
    if inline:
        head += " JSON, grammar work inline, tok/s | ratio | TPOT ms |"
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    for batch in args.batch_sizes:
        free, con = med(batch, "free", "tok_s"), med(batch, "json", "tok_s")
        line = (f"| {batch} | {free:.1f} | {con:.1f} | {con / free:.3f} | "
                f"{med(batch, 'free', 'tpot_ms'):.2f} | {med(batch, 'json', 'tpot_ms'):.2f} | "
                f"{med(batch, 'json', 'mask_ms'):.2f} |")
        if inline:
            alt = med(batch, "json-inline", "tok_s")
            line += (f" {alt:.1f} | {alt / free:.3f} | "
                     f"{med(batch, 'json-inline', 'tpot_ms'):.2f} |")
        print(line)
    if any("ttft_ms" in r for rs in results.values() for r in rs):
        print("\n| batch | unconstrained mean TTFT ms | JSON-schema mean TTFT ms | difference |")
        print("|---|---|---|---|")
        for batch in args.batch_sizes:
            free, con = med(batch, "free", "ttft_ms"), med(batch, "json", "ttft_ms")
            print(f"| {batch} | {free:.1f} | {con:.1f} | {con - free:+.1f} |")
    if any("forward_ms" in r for rs in results.values() for r in rs):
        print("\n| batch | part (ms per step, medians) | unconstrained | JSON-schema | difference |")
        print("|---|---|---|---|---|")
        for batch in args.batch_sizes:
            for part in StageTimers.PARTS:
                free = med(batch, "free", f"{part}_ms")
                con = med(batch, "json", f"{part}_ms")
                print(f"| {batch} | {part} | {free:.3f} | {con:.3f} | {con - free:+.3f} |")
    print("\nsingle runs (tok/s, in order per variant): " + "; ".join(
        f"{b} {v}: " + ", ".join(f"{r['tok_s']:.1f}" for r in rs)
        for (b, v), rs in results.items()))
    if rows:
        print("\n| schema | backend | compile ms |")
        print("|---|---|---|")
        for name, backend, ms in rows:
            print(f"| {name} | {backend} | {ms:.1f} |")


if __name__ == "__main__":
    main()
