"""Command-line flags for `EngineArgs`, with vLLM's names and meanings."""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

from flowengine.config import DTYPE_ALIASES, EngineArgs


def add_engine_args(parser: argparse.ArgumentParser, *, model_positional: bool = True) -> None:
    """Add the engine flags (`--max-model-len`, `--block-size`, ...) to `parser`."""
    if model_positional:
        parser.add_argument(
            "model",
            nargs="?",
            default=None,
            help="HF directory, .gguf file or hub id (default: SmolLM2-135M-Instruct)",
        )
        # vLLM's `serve` takes the model either way: `vllm serve MODEL` or `--model MODEL`.
        parser.add_argument(
            "--model",
            dest="model_flag",
            default=None,
            metavar="MODEL",
            help="the model, as the positional argument (vLLM's flag form)",
        )
    else:
        parser.add_argument("--model", default=None, help="model (default: SmolLM2-135M-Instruct)")
    g = parser.add_argument_group("engine")
    g.add_argument("--tokenizer", default=None)
    g.add_argument("--revision", default=None)
    g.add_argument("--download-dir", default=None)
    g.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16", *DTYPE_ALIASES],
        help="activation and weight dtype; half = float16, float = float32 (vLLM's names)",
    )
    g.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"])
    g.add_argument(
        "--quantization",
        "-q",
        default=None,
        choices=["fp8", "gguf", "int8", "gptq", "awq"],
        help="quantize weights at load: fp8 = E4M3 weights with per-channel scales and "
        "per-token dynamic activation scales (FP8 GEMMs; CUDA compute capability >= 8.9); "
        "gguf (CPU) = keep a GGUF file's Q4_0/Q4_1/Q8_0 blocks, Q4_K as Q4_1 (the default "
        "for GGUF weights on the CPU); int8 (CPU) = weight-only int8 per 32 weights of a float "
        "checkpoint; gptq / awq = a 4-bit GPTQ / AWQ checkpoint (detected from its "
        "config.json when unset)",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "float16", "bfloat16", "fp8", "fp8_e4m3"],
        help="KV cache element type: auto = the model dtype; float16 / bfloat16 = that "
        "dtype (CUDA: only the model dtype; CPU: under float32 activations too, half the "
        "bytes each decode step reads); fp8/fp8_e4m3 = float8_e4m3fn (scale 1.0), half the "
        "bytes of bf16, so twice the KV blocks",
    )
    g.add_argument(
        "--cpu-threads",
        type=int,
        default=None,
        help="intra-op threads of a CPU executor (default: the cores this process may use, "
        "from its CPU affinity and cgroup quota)",
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse KV blocks of shared prompt prefixes (default on)",
    )
    g.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="split long prompts across steps within --max-num-batched-tokens (default on); "
        "off: a prompt is prefilled in one step, and the step budget is raised to "
        "max_model_len",
    )
    g.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        default=None,
        help="KV cache budget in bytes (CPU; on GPU it overrides --gpu-memory-utilization)",
    )
    g.add_argument(
        "--num-kv-blocks",
        "--num-gpu-blocks-override",
        dest="num_kv_blocks",
        type=int,
        default=None,
        help="exact number of KV blocks, instead of profiling (GPU) or the byte budget (CPU); "
        "--num-gpu-blocks-override is vLLM's name",
    )
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    g.add_argument(
        "--enable-expert-parallel", "-ep", action="store_true", default=False,
        help="mixture-of-experts models: place whole experts on the tensor-parallel ranks "
        "(num_experts / tensor_parallel_size each) instead of splitting every expert")
    g.add_argument(
        "--data-parallel-size", "-dp", type=int, default=1,
        help="engine replicas behind this server, each with its own scheduler, KV cache "
        "and executors; requests go to the least loaded one (implies multiproc)",
    )
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="pipeline stages: the decoder layers split into this many "
                   "executor processes (or tensor-parallel groups), one micro-batch in "
                   "flight per stage (CPU; implies multiproc)")
    g.add_argument("--distributed-executor-backend", default=None,
                   choices=["mp", "ray", "uni"],
                   help="mp: executor processes on this host (default); ray: executor ranks "
                   "as Ray actors on the Ray cluster of RAY_ADDRESS or 'auto' (needs pip "
                   "install flowengine[ray])")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    g.add_argument("--placement", default="auto", choices=["auto", "inproc", "multiproc"],
                   help="inproc: all actors in one process; multiproc: engine and executor "
                   "processes over shared-memory rings; auto (default): multiproc for the "
                   "server on CUDA, inproc on the CPU")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="plan step N+1 during step N (default: on for the server on CUDA "
                   "without pipeline parallelism, off on the CPU)")
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    g.add_argument("--max-logprobs", type=int, default=20)
    g.add_argument(
        "--structured-outputs-backend",
        "--guided-decoding-backend",
        default="auto",
        choices=["auto", "xgrammar", "guidance"],
        help="grammar library for structured outputs (vLLM's flag): auto takes xgrammar "
        "and llguidance for JSON schemas with keywords xgrammar does not support",
    )
    g.add_argument("--served-model-name", nargs="+", default=None)
    g.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="no periodic stats line (throughput, running/waiting, KV cache usage, prefix "
        "cache hit rate) every $FLOWENGINE_LOG_STATS_INTERVAL seconds (default 10)",
    )
    g.add_argument(
        "--enable-log-requests",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="one INFO line per admitted request: id, prompt token count, sampling "
        "parameters (prompt content only with --max-log-len)",
    )
    g.add_argument(
        "--max-log-len",
        type=int,
        default=None,
        help="with --enable-log-requests: also log the first N prompt characters and "
        "token ids (default: no prompt content; prompts are user data)",
    )
    g.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="streamed responses get a chunk every N generated tokens, plus the first "
        "token's and the last one's at once (vLLM's and SGLang's flag); 1 (default) "
        "sends each token as it comes; a larger N lowers the server's work per token "
        "under heavy streaming load",
    )
    g.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="let transformers run the Python code a model repository ships for its config "
        "and tokenizer classes (auto_map); without it such a model is refused with an error. "
        "The model forward is always FlowEngine's own",
    )
    g.add_argument(
        "--generation-config",
        default="auto",
        help="sampling defaults (temperature, top_p, top_k, min_p, repetition_penalty, "
        "max_new_tokens as max_tokens) for requests that do not set them: 'auto' reads the "
        "model's generation_config.json, 'vllm' ignores it, a folder reads that folder's",
    )
    g.add_argument(
        "--override-generation-config",
        type=_json_object,
        default=None,
        help='JSON object applied over the generation config, e.g. \'{"temperature": 0.5}\'',
    )
    g.add_argument(
        "--runner",
        default="auto",
        choices=["auto", "generate", "pooling"],
        help="'generate' samples tokens; 'pooling' serves embeddings (/v1/embeddings): "
        "prefill-only requests return pooled hidden states; 'auto' picks 'pooling' for "
        "encoder-only models (BERT) and 'generate' for the rest (vLLM's --runner)",
    )
    g.add_argument(
        "--pooler-config",
        type=_json_object,
        default=None,
        help='pooling runner: JSON object with pooling_type ("CLS", "MEAN", "LAST") and '
        "normalize, over the model's sentence-transformers config, e.g. "
        "'{\"pooling_type\": \"MEAN\", \"normalize\": true}'",
    )
    g.add_argument(
        "--speculative-config",
        type=_json_object,
        default=None,
        help="speculative decoding, vLLM's JSON: '{\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}' (prompt lookup) or "
        "'{\"model\": DIR, \"num_speculative_tokens\": 4}' (a draft model with the same "
        "tokenizer); outputs are unchanged, only faster",
    )
    g.add_argument(
        "--chat-template",
        default=None,
        help="Jinja chat template for chat requests instead of the tokenizer's: a file "
        "path, or the template itself",
    )


def _json_object(text: str) -> dict[str, Any]:
    import orjson

    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not valid JSON: {err}") from err
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def engine_args_from(ns: argparse.Namespace, **overrides: Any) -> EngineArgs:
    """Build `EngineArgs` from parsed flags (only the fields EngineArgs has)."""
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    values = {k: v for k, v in vars(ns).items() if k in names and v is not None}
    flag = getattr(ns, "model_flag", None)
    if flag is not None:
        if values.get("model", flag) != flag:
            raise ValueError(f"two models given: {values['model']!r} (positional) and "
                             f"--model {flag!r}; give one")
        values["model"] = flag
    values.update(overrides)
    if "served_model_name" in values:
        values["served_model_name"] = tuple(values["served_model_name"])
    return EngineArgs.from_kwargs(**values)


def env_default(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name, default)
