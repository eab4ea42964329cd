"""Engine configuration: every knob a user can set, validated in one place.

`EngineArgs` carries vLLM's argument names (`max_model_len`, `max_num_seqs`,
`max_num_batched_tokens`, `block_size`, `enable_prefix_caching`,
`gpu_memory_utilization`, `tensor_parallel_size`, ...), so that vLLM scripts and flags
carry over. `LLM(**kwargs)`, `AsyncEngine(**kwargs)` and `flowengine serve --flags`
all build one. Unknown keyword arguments raise `TypeError` naming the argument.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any, Literal

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
# vLLM's other spellings of a dtype (its --dtype choices "half" and "float"), kept as
# the canonical name: "half" is float16, "float" is float32.
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
LoadFormat = Literal["auto", "safetensors", "gguf", "dummy"]
Device = Literal["auto", "cpu", "cuda"]
Placement = Literal["auto", "inproc", "multiproc"]
Runner = Literal["auto", "generate", "pooling"]
SchedulingPolicy = Literal["fcfs", "priority"]
StructuredOutputsBackend = Literal["auto", "xgrammar", "guidance"]
# Weight quantization applied at load (vLLM's --quantization); None: weights as loaded
# (except GGUF weights on the CPU, which stay "gguf"). fp8: E4M3 W8A8 (CUDA); gguf:
# keep a GGUF file's Q4_0/Q4_1/Q8_0 blocks, Q4_K as Q4_1 (CPU); int8: weight-only, per 32 weights (CPU);
# gptq / awq: a 4-bit checkpoint's own format (also chosen when unset, from config.json).
Quantization = Literal["fp8", "gguf", "int8", "gptq", "awq"]
# KV cache element type (vLLM's --kv-cache-dtype): "auto" = the model dtype; "float16" /
# "bfloat16" = that dtype (on CUDA only where it is the model dtype; on the CPU under any,
# widened to float32 as attention reads it); "fp8" and "fp8_e4m3" (the same on CUDA and
# CPU here) = float8_e4m3fn with scale 1.0.
KVCacheDtype = Literal["auto", "float16", "bfloat16", "fp8", "fp8_e4m3"]

# KV-cache budget on the CPU when the user gives none: enough for a few thousand
# tokens of a small model, small enough for a 24 GiB CI machine.
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


# vLLM names accepted for a field that carries another name here (same meaning).
ENGINE_ARG_ALIASES = {"num_gpu_blocks_override": "num_kv_blocks"}


@dataclass(frozen=True, kw_only=True)
class EngineArgs:
    """User-facing engine arguments (vLLM names). See `validate()` for the rules.

    Units: `kv_cache_memory_bytes` in bytes; `gpu_memory_utilization` a fraction of
    device memory in (0, 1]; lengths in tokens.
    """

    model: str | None = None
    tokenizer: str | None = None
    revision: str | None = None
    download_dir: str | None = None
    dtype: Dtype = "auto"
    load_format: LoadFormat = "auto"
    quantization: Quantization | None = None
    kv_cache_dtype: KVCacheDtype = "auto"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    kv_cache_memory_bytes: int | None = None
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    # vLLM's --enable-expert-parallel: with tensor_parallel_size N, a mixture-of-experts
    # layer's experts are placed whole on the ranks (E / N each) instead of each expert's
    # width being split (flowengine/distributed/expert_parallel.py).
    enable_expert_parallel: bool = False
    # Engine replicas behind one frontend, each with its own scheduler, KV cache and
    # executors (vLLM's --data-parallel-size; flowengine/engine/dp_router.py).
    data_parallel_size: int = 1
    # vLLM's --pipeline-parallel-size: the decoder layers split into this many stages,
    # one executor process (or tensor-parallel group) each (flowengine/distributed/
    # pp_group.py); the scheduler keeps one micro-batch per stage in flight.
    pipeline_parallel_size: int = 1
    # vLLM's --distributed-executor-backend: "mp" (processes on this host, the
    # default) or "ray" (the executor ranks as Ray actors on a Ray cluster; needs the
    # `ray` extra: flowengine/executor/ray_executor.py).
    distributed_executor_backend: str | None = None
    device: Device = "auto"
    enforce_eager: bool = False
    # "inproc": every actor in one process; "multiproc": engine and executor processes
    # over shared-memory rings (always so when tensor/data/pipeline_parallel_size > 1).
    # "auto": see `settle_defaults`.
    placement: Placement = "auto"
    # Plan step N+1 while step N runs (DESIGN.md §5; vLLM's --async-scheduling). None:
    # where it helps, as vLLM enables it by default: see `settle_defaults`.
    async_scheduling: bool | None = None
    scheduling_policy: SchedulingPolicy = "fcfs"
    max_logprobs: int = 20
    # Grammar library for structured outputs (vLLM's --structured-outputs-backend).
    structured_outputs_backend: StructuredOutputsBackend = "auto"
    served_model_name: tuple[str, ...] = field(default_factory=tuple)
    # No periodic stats line (engine/stat_logger.py); LLM() turns it off by default.
    disable_log_stats: bool = False
    # Let transformers run a model repository's config/tokenizer code (auto_map).
    trust_remote_code: bool = False
    # One INFO line per admitted request (engine/request_logger.py); prompt content only
    # up to max_log_len characters/token ids when that is given (None: none).
    enable_log_requests: bool = False
    max_log_len: int | None = None
    # Streamed outputs (DELTA and CUMULATIVE kinds) go to the caller every this many
    # tokens, besides the first and the last (vLLM's and SGLang's --stream-interval):
    # 1 sends every token; more means fewer, larger chunks and less frontend work per
    # token (engine/output_processor.py).
    stream_interval: int = 1
    # Sampling defaults from generation_config.json: "auto" (the model's), "vllm" (none)
    # or a folder; override_generation_config is applied over it (vLLM's flags;
    # flowengine/model/generation_config.py).
    generation_config: str = "auto"
    override_generation_config: dict[str, Any] | None = None
    # Jinja chat template (a file path or the template text) instead of the tokenizer's
    # (vLLM's --chat-template; flowengine/tokenize/chat.py load_chat_template).
    chat_template: str | None = None
    # vLLM's --runner: "generate" (sampling) or "pooling" (embeddings: prefill-only
    # requests return pooled hidden states); "auto" picks "pooling" for encoder-only
    # models. pooler_config: vLLM's --pooler-config fields pooling_type ("CLS", "MEAN",
    # "LAST") and normalize, over the model's sentence-transformers config
    # (flowengine/pooling/config.py).
    runner: Runner = "auto"
    pooler_config: dict[str, Any] | None = None
    # Intra-op threads of a CPU executor; None: the cores this process may use
    # (affinity, cgroup CPU quota), shared among the tensor-parallel ranks.
    cpu_threads: int | None = None
    # vLLM's --speculative-config (flowengine/spec_decode/config.py): method "ngram"
    # (num_speculative_tokens, prompt_lookup_min/max) or a draft "model".
    speculative_config: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.dtype in DTYPE_ALIASES:
            object.__setattr__(self, "dtype", DTYPE_ALIASES[self.dtype])
        self.validate()
        if (self.tensor_parallel_size > 1 or self.data_parallel_size > 1
                or self.pipeline_parallel_size > 1
                or self.distributed_executor_backend == "ray") and self.placement != "multiproc":
            # One process per rank, one group per replica (Ray: actors under a driver
            # process): always multiproc.
            object.__setattr__(self, "placement", "multiproc")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        """Build from keyword arguments; an unknown name raises `TypeError` with a hint."""
        for alias, name in ENGINE_ARG_ALIASES.items():
            if alias in kwargs:
                if name in kwargs:
                    raise TypeError(f"give {name!r} or its alias {alias!r}, not both")
                kwargs[name] = kwargs.pop(alias)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = [k for k in kwargs if k not in names]
        if unknown:
            hints = []
            for k in unknown:
                close = difflib.get_close_matches(k, names, n=1)
                hints.append(f"{k!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise TypeError(f"unknown engine argument(s): {', '.join(hints)}")
        if isinstance(kwargs.get("served_model_name"), (list, str)):
            smn = kwargs["served_model_name"]
            kwargs["served_model_name"] = (smn,) if isinstance(smn, str) else tuple(smn)
        return cls(**kwargs)

    def validate(self) -> None:
        """Raise `ValueError` naming the argument and what to change."""
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128; got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if self.pipeline_parallel_size < 1:
            raise ValueError(
                f"pipeline_parallel_size must be >= 1, got {self.pipeline_parallel_size}")
        if self.pipeline_parallel_size > 1:
            pp = self.pipeline_parallel_size
            if self.async_scheduling:
                raise ValueError(
                    f"pipeline_parallel_size {pp} keeps {pp} steps in flight, one per stage, "
                    "without placeholder tokens; turn async_scheduling off")
            if self.speculative_config is not None:
                raise ValueError(f"speculative_config needs pipeline_parallel_size 1 (the "
                                 f"draft verification runs on one rank), got {pp}")
        validate_executor_backend(self.distributed_executor_backend)
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ValueError(f"max_log_len must be >= 0, got {self.max_log_len}")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}")
        if not self.generation_config:
            raise ValueError("generation_config must be 'auto', 'vllm' or a folder, got ''")
        if self.override_generation_config is not None and not isinstance(
            self.override_generation_config, dict
        ):
            raise ValueError(
                "override_generation_config must be a dict (JSON object), got "
                f"{type(self.override_generation_config).__name__}"
            )
        if self.pooler_config is not None and not isinstance(self.pooler_config, dict):
            raise ValueError("pooler_config must be a dict (JSON object), got "
                             f"{type(self.pooler_config).__name__}")
        if self.quantization is not None and self.quantization not in Quantization.__args__:
            raise ValueError(f"quantization must be one of {Quantization.__args__} or None, "
                             f"got {self.quantization!r}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1, got {self.cpu_threads}")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be >= 0, or -1 for no limit (vLLM's), "
                             f"got {self.max_logprobs}")
        if self.speculative_config is not None:
            from flowengine.spec_decode.config import SpeculativeConfig

            SpeculativeConfig.parse(self.speculative_config)  # raises ValueError
            if self.tensor_parallel_size > 1:
                raise ValueError("speculative_config needs tensor_parallel_size 1 (the draft "
                                 "verification runs on one rank)")
        for name, allowed in (
            ("dtype", Dtype),
            ("load_format", LoadFormat),
            ("device", Device),
            ("placement", Placement),
            ("scheduling_policy", SchedulingPolicy),
            ("structured_outputs_backend", StructuredOutputsBackend),
            ("runner", Runner),
            ("kv_cache_dtype", KVCacheDtype),
        ):
            value = getattr(self, name)
            if value not in allowed.__args__:
                raise ValueError(f"{name} must be one of {allowed.__args__}, got {value!r}")


def settle_defaults(args: EngineArgs, device: str, *, frontend: bool) -> EngineArgs:
    """`args` with placement "auto" and async_scheduling None made concrete; `args`
    itself when both are set already.

    "auto" is "multiproc" on CUDA for a caller that can start the engine processes
    (frontend=True: `flowengine serve`, `submit()`'s `AsyncEngine`, and the offline `LLM`,
    which then drives the same engine from a background event loop): in one process the
    routes, detokenizer and output processing share a GIL with the step loop and the
    device waits on them (H200, SmolLM2 shapes at concurrency 256: served / offline 0.28
    in process against 0.66 multiproc; Llama-3.1-8B shapes, FP8, `flowengine bench
    throughput` 1,000 x 200/200: 17,083 output tok/s in process against 20,824, both in
    docs/benchmarks.md), which is why vLLM also runs its engine core in a process of its
    own, for its `LLM` too. It is "inproc" on the CPU (the executor's threads want the
    cores a second process would take).

    async_scheduling None is True for such a caller on CUDA without pipeline parallelism
    (which keeps one step per stage in flight instead), as vLLM turns it on by default:
    the scheduler plans step N+1 while the device runs step N (H200, the server's
    default placement: served / offline 0.41 without it, 0.55 with it, in
    docs/benchmarks.md). It is False on the CPU, where the step is the device and
    nothing is left to overlap. (An `LLM` placed in process runs `EngineCore.step()`,
    one step at a time, whatever this says.)

    Args:
        args: the engine arguments.
        device: the resolved device, "cuda" or "cpu".
        frontend: True where the caller can start the engine processes (`AsyncEngine`,
            `LLM`); False for an `AsyncEngine` given a `core_factory` (its core is built
            in this process) and for the engine's own processes.
    """
    if args.placement == "auto":
        placement = "multiproc" if frontend and device == "cuda" else "inproc"
        args = dataclasses.replace(args, placement=placement)
    if args.async_scheduling is None:
        on = frontend and device == "cuda" and args.pipeline_parallel_size == 1
        args = dataclasses.replace(args, async_scheduling=on)
    return args


def with_settled_defaults(args: EngineArgs, settled: EngineArgs) -> EngineArgs:
    """`args` with the placement and async_scheduling that `settled` (the args `resolve`
    settled with `settle_defaults`) holds: a caller keeps its own args but the one
    decision `resolve` made."""
    return dataclasses.replace(args, placement=settled.placement,
                               async_scheduling=settled.async_scheduling)


def validate_executor_backend(backend: str | None) -> None:
    """Check --distributed-executor-backend (vLLM's values "mp", "ray", "uni"; None is
    "mp"). Raises ValueError for an unknown value, ImportError naming the extra to
    install when "ray" is asked for without Ray."""
    if backend is None or backend in ("mp", "uni"):
        return
    if backend != "ray":
        raise ValueError(f"distributed_executor_backend must be 'mp', 'ray' or 'uni', "
                         f"got {backend!r}")
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise ImportError("distributed_executor_backend 'ray' needs Ray: "
                          "pip install flowengine[ray]")


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits the scheduler applies each step (DESIGN.md §4). All counts in tokens/seqs."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    policy: SchedulingPolicy = "fcfs"


@dataclass(frozen=True)
class CacheConfig:
    """KV cache geometry: `num_blocks` blocks of `block_size` tokens each.

    `sliding_window`: the attention window (tokens) shared by every layer of the model,
    or None; with one, blocks out of the window are freed (flowengine/core/
    sliding_window.py) and one block is the null block, held by no request.
    """

    block_size: int
    num_blocks: int
    enable_prefix_caching: bool = True
    sliding_window: int | None = None

    @property
    def num_usable_blocks(self) -> int:
        """Blocks requests can hold: `num_blocks`, less the null block of a window."""
        return self.num_blocks - (self.sliding_window is not None)
