"""Structured outputs on the CPU: throughput and TPOT with a JSON-schema constraint
against the same workload unconstrained, and grammar compile times (issue 13).

    python benchmarks/structured_outputs.py [--batch-sizes 1 32] [--output-len 48]
        [--reps 2] [--device cpu]

Workload: the default model (SmolLM2-135M-Instruct), `batch` copies of one short chat
prompt, exactly `output_len` tokens each. Constrained: a JSON schema (an array of at
least 40 records) whose every output is longer than output_len, so each request is cut
by max_tokens at the same length as the unconstrained run (ignore_eos). Runs of the
two alternate (unconstrained, constrained, ...) `reps` times per batch size; the
table gives the medians. TPOT = mean duration of the decode steps (every step after
the first, which prefills the batch); mask = the CPU time the scheduler spent filling
bitmasks per step (inside TPOT). Then the compile time of each of the 30 schemas of
tests/data/json_schemas.json on a fresh backend (no cache), xgrammar or llguidance as
"auto" picks. Prints markdown tables last, with the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from flowengine import LLM, SamplingParams, StructuredOutputsParams
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


def run_once(llm: LLM, prompt: str, batch: int, output_len: int, constrained: bool,
             steps: list[float], masks: list[float]) -> dict[str, float]:
    so = StructuredOutputsParams(json=SCHEMA) if constrained else None
    params = SamplingParams(temperature=1.0, max_tokens=output_len, ignore_eos=not constrained,
                            seed=1, structured_outputs=so)
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
    return {"tok_s": tokens / wall, "tpot_ms": 1e3 * statistics.mean(decode),
            "mask_ms": 1e3 * sum(masks) / max(len(decode), 1)}


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    llm = LLM(device=args.device, max_num_seqs=max(args.batch_sizes), seed=0)
    tokenizer = llm.input_processor.tokenizer
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "List some user records as JSON."}], tokenize=False,
        add_generation_prompt=True)
    steps, masks = _timed_steps(llm)
    run_once(llm, prompt, 1, 4, True, steps, masks)  # warm-up: tokenizer info, compile
    load_before = os.getloadavg()
    results: dict[tuple[int, bool], list[dict[str, float]]] = {}
    for batch in args.batch_sizes:
        for _ in range(args.reps):
            for constrained in (False, True):
                r = run_once(llm, prompt, batch, args.output_len, constrained, steps, masks)
                results.setdefault((batch, constrained), []).append(r)
                print(f"batch {batch} {'json' if constrained else 'free'}: {r}", flush=True)
    load_after = os.getloadavg()
    rows = compile_times(tokenizer, llm.resolved.model_config.vocab_size)

    def med(batch: int, constrained: bool, key: str) -> float:
        return statistics.median(r[key] for r in results[(batch, constrained)])

    print(f"\nload average before {load_before[0]:.2f}, after {load_after[0]:.2f} "
          f"({os.cpu_count()} CPUs); {args.reps} alternated runs per cell, medians; "
          f"output {args.output_len} tokens per request\n")
    print("| batch | unconstrained tok/s | JSON-schema tok/s | ratio | unconstrained TPOT ms "
          "| JSON-schema TPOT ms | mask fill ms/step |")
    print("|---|---|---|---|---|---|---|")
    for batch in args.batch_sizes:
        free, con = med(batch, False, "tok_s"), med(batch, True, "tok_s")
        print(f"| {batch} | {free:.1f} | {con:.1f} | {con / free:.3f} | "
              f"{med(batch, False, 'tpot_ms'):.1f} | {med(batch, True, 'tpot_ms'):.1f} | "
              f"{med(batch, True, 'mask_ms'):.2f} |")
    print("\n| schema | backend | compile ms |")
    print("|---|---|---|")
    for name, backend, ms in rows:
        print(f"| {name} | {backend} | {ms:.1f} |")
    llm.shutdown()


if __name__ == "__main__":
    main()
