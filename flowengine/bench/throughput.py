"""`flowengine bench throughput`: offline throughput on random prompts.

    flowengine bench throughput --num-prompts 64 --input-len 128 --output-len 128 --hf

Prompts are random token ids of exactly `--input-len` tokens; every request generates
exactly `--output-len` tokens (`ignore_eos`). With `--hf`, Hugging Face transformers
`generate` runs on the same prompts in the same process, after FlowEngine, with the
same weights and dtype, in batches of `--hf-batch-size` (equal lengths: no padding).
"""

from __future__ import annotations

import argparse
import random
import shlex
import sys
import time
from dataclasses import dataclass

from flowengine.entrypoints.cli_args import add_engine_args, engine_args_from
from flowengine.sampling_params import SamplingParams


@dataclass
class Result:
    name: str
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    elapsed_s: float

    def row(self) -> str:
        return (
            f"| {self.name} | {self.num_requests} | {self.elapsed_s:.2f} | "
            f"{self.num_requests / self.elapsed_s:.2f} | "
            f"{self.output_tokens / self.elapsed_s:.1f} | "
            f"{(self.prompt_tokens + self.output_tokens) / self.elapsed_s:.1f} |"
        )


def random_prompts(num: int, input_len: int, vocab_size: int, special: set[int], seed: int):
    rng = random.Random(seed)
    allowed = [t for t in range(min(vocab_size, 32000)) if t not in special]
    return [[rng.choice(allowed) for _ in range(input_len)] for _ in range(num)]


def run_flowengine(llm, prompts: list[list[int]], output_len: int, temperature: float = 0.0,
                   top_p: float = 1.0) -> Result:
    """Time `llm.generate` over `prompts` (token ids), `output_len` tokens each
    (ignore_eos), greedy by default."""
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=output_len,
                            ignore_eos=True)
    warm = llm.generate(prompts[:2], SamplingParams(max_tokens=2, ignore_eos=True),
                        use_tqdm=False)
    _raise_on_errors(warm, "the warm-up")
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    _raise_on_errors(outs, "the timed run")
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return Result("flowengine", len(prompts), sum(map(len, prompts)), n_out, elapsed)


class BenchError(RuntimeError):
    """Requests of a benchmark run ended in an error: no figure is reported."""


def _raise_on_errors(outs, what: str) -> None:
    """BenchError when any request of `outs` finished with finish_reason "error" (the
    engine keeps serving after a failed step and answers its requests with that
    reason; a throughput over them would count the missing tokens as fast)."""
    failed = sum(1 for o in outs if o.outputs and o.outputs[0].finish_reason == "error")
    if failed:
        raise BenchError(f"{failed} of {len(outs)} requests of {what} failed (finish_reason "
                         "\"error\"; the engine log says why): no throughput reported")


def load_hf_model(model_path: str, dtype: str, device: str, dummy: bool, **kwargs):
    """The transformers model: from the checkpoint, or random weights (dummy) of the
    same config, since throughput does not depend on weight values."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype)
    if dummy:
        config = AutoConfig.from_pretrained(model_path, **kwargs)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype, **kwargs)
    return model.to(device).eval()


def run_hf(model_path: str, dtype: str, device: str, prompts, output_len: int, batch: int,
           dummy: bool = False):
    import torch

    model = load_hf_model(model_path, dtype, device, dummy)
    n_out = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            ids = torch.tensor(prompts[i : i + batch], device=device)
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                do_sample=False,
                pad_token_id=0,
            )
            n_out += (out.shape[1] - ids.shape[1]) * out.shape[0]
    elapsed = time.perf_counter() - start
    name = f"transformers generate (batch {batch})"
    return Result(name, len(prompts), sum(map(len, prompts)), n_out, elapsed)


def run_hf_continuous(model_path: str, dtype: str, device: str, prompts, output_len: int,
                      dummy: bool = False):
    """transformers' own continuous batching (`generate_batch`, paged attention)."""
    from transformers import GenerationConfig

    model = load_hf_model(model_path, dtype, device, dummy, attn_implementation="paged|sdpa")
    config = GenerationConfig(
        max_new_tokens=output_len, do_sample=False, eos_token_id=None, pad_token_id=0,
        use_cuda_graph=False,
    )
    model.generate_batch(prompts[:4], generation_config=config)  # warm-up
    start = time.perf_counter()
    results = model.generate_batch(prompts, generation_config=config)
    elapsed = time.perf_counter() - start
    n_out = sum(len(r.generated_tokens) for r in results.values())
    name = "transformers generate_batch (continuous batching, paged)"
    return Result(name, len(prompts), sum(map(len, prompts)), n_out, elapsed)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="flowengine bench throughput", description=__doc__)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prompt-seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of every request (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="top-p of every request")
    p.add_argument("--hf", action="store_true", help="also run transformers generate")
    p.add_argument(
        "--hf-backend",
        choices=["generate", "generate_batch"],
        default="generate",
        help="transformers path: padded-batch generate, or continuous batching",
    )
    p.add_argument(
        "--hf-batch-size",
        default="64",
        help="transformers generate batch size; a comma list runs each (e.g. 1,64)",
    )
    p.add_argument("--hf-num-prompts", type=int, default=None, help="subset for transformers")
    add_engine_args(p, model_positional=False)
    ns = p.parse_args(argv)

    from flowengine.entrypoints.llm import LLM

    llm = LLM(**vars(engine_args_from(ns)))
    tok = llm.get_tokenizer()
    special = set(getattr(tok, "all_special_ids", []))
    prompts = random_prompts(
        ns.num_prompts, ns.input_len, llm.resolved.model_config.vocab_size, special, ns.prompt_seed
    )
    try:
        results = [run_flowengine(llm, prompts, ns.output_len, ns.temperature, ns.top_p)]
    except BenchError as e:
        print(f"flowengine bench throughput: {e}", file=sys.stderr)
        return 1
    print(f"flowengine: {results[0].row()}", flush=True)  # before transformers runs
    if ns.hf:
        llm.shutdown()
        del llm
        import gc

        import torch

        gc.collect()  # hand the engine's GPU memory (KV cache, graphs) to transformers
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        hf_prompts = prompts[: ns.hf_num_prompts or len(prompts)]
        resolved = engine_args_from(ns)
        from flowengine.engine.builder import resolve

        r = resolve(resolved)
        dummy = ns.load_format == "dummy"
        if ns.hf_backend == "generate_batch":
            results.append(run_hf_continuous(r.model_path, r.dtype, r.device, hf_prompts,
                                             ns.output_len, dummy))
        else:
            for batch in (int(b) for b in str(ns.hf_batch_size).split(",")):
                results.append(run_hf(r.model_path, r.dtype, r.device, hf_prompts,
                                      ns.output_len, batch, dummy))
                print(f"transformers: {results[-1].row()}", flush=True)
    print(f"\ncommand: flowengine bench throughput {shlex.join(argv)}")
    print(f"prompts: {ns.num_prompts} x {ns.input_len} in / {ns.output_len} out, ignore_eos\n")
    print("| engine | requests | elapsed s | requests/s | output tok/s | total tok/s |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(r.row())
    ours = results[0].output_tokens / results[0].elapsed_s
    for other in results[1:]:
        ratio = ours / (other.output_tokens / other.elapsed_s)
        print(f"\noutput tok/s ratio flowengine / {other.name}: {ratio:.2f}x")
    sys.stdout.flush()
    return 0
