"""Build an engine from `EngineArgs`: resolve the model, size the KV cache, wire parts.

Split into parts that can live in different processes: `resolve()` (model files,
limits), `build_executor()` (weights, KV cache), `build_scheduler()`; in one process
`build_engine_core()` joins the last two.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from flowengine.config import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    CacheConfig,
    EngineArgs,
    SchedulerConfig,
    settle_defaults,
)

logger = logging.getLogger(__name__)

# Default step token budget (vLLM's default for online serving with chunked prefill).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


@dataclass(frozen=True)
class ResolvedEngine:
    """Everything both halves agree on, derived once from `EngineArgs`."""

    args: EngineArgs
    model_path: str
    model_config: Any  # flowengine.model.model_config.ModelConfig
    max_model_len: int
    max_num_batched_tokens: int
    device: str
    dtype: str
    served_model_names: tuple[str, ...]
    # "generate" or "pooling" (flowengine/pooling/config.py); the pooling runner's
    # PoolerConfig, else None.
    runner: str = "generate"
    pooler_config: Any = None
    # `--dtype bfloat16` with quantized weights on the CPU (gguf, int8): the model runs
    # in float32 (its fused decode kernels are float32) and, on a CPU with native bf16
    # GEMMs, its quantized matmuls take bf16 products from `bf16_rows` (AMX tiles for
    # batched decode, one bf16 GEMM for the prefill; layers/quant_linear.py) and its KV
    # cache is bf16. True where that is so.
    bf16_gemm: bool = False


def resolve(args: EngineArgs, *, frontend: bool = False) -> ResolvedEngine:
    """Find the model files and settle the limits, and placement "auto" and
    async_scheduling None for the device (`settle_defaults`; frontend: True for a caller
    that can start the engine processes, an `AsyncEngine` without a core_factory or an
    `LLM`). Raises ValueError with what to change."""
    import torch

    from flowengine.model.model_config import ModelConfig
    from flowengine.model.resolve import resolve_model

    resolved = resolve_model(args.model, download_dir=args.download_dir, revision=args.revision)
    model_config = ModelConfig.from_pretrained(
        resolved.path, args.max_model_len, trust_remote_code=args.trust_remote_code
    )
    runner, pooler_config = _resolve_runner(args, model_config, resolved.path)
    if runner == "pooling":
        # Prefill-only requests computed whole in one step (the pooler reads all of a
        # prompt's states at once; an encoder attends bidirectionally) and never shared
        # through the prefix cache (mean pooling needs every token's state).
        args = dataclasses.replace(args, runner="pooling", enable_chunked_prefill=False,
                                   enable_prefix_caching=False)
        model_config = _cap_at_sentence_transformers_len(args, model_config, resolved.path)
    max_model_len = model_config.max_model_len
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for, but torch sees no CUDA device")
    _check_tensor_parallel(args, model_config, device)
    if args.enable_expert_parallel:
        from flowengine.distributed.expert_parallel import check_expert_parallel

        check_expert_parallel(model_config.num_experts, args.tensor_parallel_size)
        model_config = dataclasses.replace(model_config, enable_expert_parallel=True)
    _check_draft_model(args)
    dtype = args.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    if device == "cuda" and args.kv_cache_dtype in ("float16", "bfloat16") \
            and args.kv_cache_dtype != dtype:
        raise ValueError(f"--kv-cache-dtype {args.kv_cache_dtype} with --dtype {dtype} on "
                         "CUDA: the GPU attention kernels read a cache of the model dtype or "
                         "fp8; use auto, fp8, or --dtype " + args.kv_cache_dtype)
    args = _resolve_quantization(args, device, resolved.gguf_file)
    if (device == "cpu" and args.quantization == "gguf" and args.dtype == "auto"
            and args.kv_cache_dtype == "auto"):
        # vLLM runs GGUF weights in float16 and llama.cpp keeps their K/V in float16:
        # the activations stay float32 here (the C kernels'), the KV cache is float16,
        # half the bytes a decode step's attention reads (--dtype float32: all float32).
        args = dataclasses.replace(args, kv_cache_dtype="float16")
    bf16_gemm = False
    if device == "cpu" and dtype == "bfloat16" and args.quantization in ("gguf", "int8"):
        from flowengine.executor.cpu_threads import bf16_matmul_path

        # bf16 activations would take the per-operator decode path, 1.7x slower per
        # 16-row step than the float32 fused kernels (docs/benchmarks.md, issue 20).
        dtype = "float32"
        bf16_gemm = bf16_matmul_path()[0]
    args = settle_defaults(args, device, frontend=frontend)
    budget = args.max_num_batched_tokens or max(DEFAULT_MAX_NUM_BATCHED_TOKENS, 0)
    if not args.enable_chunked_prefill:
        budget = max(budget, max_model_len)
    name = args.model or resolved.name
    if args.model is None:
        # Pin the default model to the files found here: the engine and executor
        # processes resolve args again and must not pick another source (the hub's copy
        # or the GGUF fallback) if the network changed meanwhile.
        args = dataclasses.replace(args, model=str(resolved.path),
                                   served_model_name=args.served_model_name or (name,))
    return ResolvedEngine(
        args=args,
        model_path=str(resolved.path),
        model_config=model_config,
        max_model_len=max_model_len,
        max_num_batched_tokens=budget,
        device=device,
        dtype=dtype,
        served_model_names=args.served_model_name or (name,),
        runner=runner,
        pooler_config=pooler_config,
        bf16_gemm=bf16_gemm,
    )


def _resolve_quantization(args: EngineArgs, device: str, gguf_file: str | None) -> EngineArgs:
    """GGUF weights on the CPU stay quantized unless the user chose otherwise (vLLM
    loads a GGUF file with quantization "gguf"); "gguf" reads the GGUF file itself.
    Raises ValueError for a quantization the device or the weights cannot take."""
    from flowengine.model.layers.quant_linear import kernels_available

    quantization = args.quantization
    if (quantization is None and device == "cpu" and gguf_file is not None
            and args.load_format in ("auto", "gguf") and kernels_available()):
        quantization = "gguf"
    if quantization in ("gguf", "int8") and device != "cpu":
        raise ValueError(f"quantization {quantization!r} runs on the CPU only; on {device} "
                         "leave --quantization unset (GGUF weights are dequantized there)")
    if quantization in ("gguf", "int8") and not kernels_available():
        raise ValueError(f"quantization {quantization!r} needs FlowEngine's C extension "
                         "flowengine._cpu_ops, which is not built; reinstall with a C compiler "
                         "(pip install -e .)")
    if quantization == "gguf" and args.load_format not in ("auto", "gguf"):
        raise ValueError(f"quantization 'gguf' reads a GGUF file; --load-format "
                         f"{args.load_format} cannot go with it")
    load_format = "gguf" if quantization == "gguf" else args.load_format
    if (quantization, load_format) == (args.quantization, args.load_format):
        return args
    return dataclasses.replace(args, quantization=quantization, load_format=load_format)


def _resolve_runner(args: EngineArgs, model_config: Any, model_path: str) -> tuple[str, Any]:
    """("generate", None) or ("pooling", PoolerConfig). Raises ValueError as
    flowengine.pooling.config's resolve_runner / resolve_pooler_config."""
    from flowengine.pooling.config import resolve_pooler_config, resolve_runner

    runner = resolve_runner(args.runner, model_config.is_encoder_only, model_config.architecture)
    if runner != "pooling":
        if args.pooler_config:
            raise ValueError("pooler_config applies to the pooling runner; add runner "
                             "'pooling' (--runner pooling)")
        return runner, None
    return runner, resolve_pooler_config(str(model_path), model_config.is_encoder_only,
                                         args.pooler_config)


def _cap_at_sentence_transformers_len(args: EngineArgs, model_config: Any,
                                      model_path: str) -> Any:
    """max_model_len capped at sentence_bert_config.json's max_seq_length when the user
    gave none (sentence-transformers truncates there; vLLM caps there too)."""
    from flowengine.pooling.config import sentence_transformers_max_seq_length

    limit = sentence_transformers_max_seq_length(str(model_path))
    if args.max_model_len is not None or limit is None or limit >= model_config.max_model_len:
        return model_config
    return dataclasses.replace(model_config, max_model_len=limit)


def encoder_num_blocks(resolved: ResolvedEngine) -> int:
    """Blocks of an encoder's trivial KV cache (no tensors, accounting only): room for
    two steps' worth of prompts (the step in flight and the next one, whose blocks are
    freed only after it), each step up to max_num_batched_tokens tokens in at most
    max_num_seqs requests, every request rounding up to whole blocks."""
    args = resolved.args
    per_step = -(-resolved.max_num_batched_tokens // args.block_size) + args.max_num_seqs
    return 2 * per_step


def _check_tensor_parallel(args: EngineArgs, model_config: Any, device: str) -> None:
    from flowengine.distributed.pp_group import check_pipeline_parallel
    from flowengine.distributed.tp_group import check_tensor_parallel

    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    check_tensor_parallel(model_config.num_heads, model_config.num_kv_heads,
                          model_config.intermediate_size, tp)
    if pp > 1:
        if model_config.is_encoder_only:
            raise ValueError(f"pipeline_parallel_size {pp}: {model_config.architecture} is "
                             "an encoder (pooling runner); serve it with "
                             "pipeline_parallel_size 1")
        check_pipeline_parallel(model_config.num_layers, pp)
        _check_stages_supported(model_config)
        # On CUDA each rank drives its own GPU, NCCL between the stages, every stage
        # eager (flowengine/executor/cuda_stage.py); speculative decoding is refused
        # under pipeline parallelism in EngineArgs.
    # Ray spreads the ranks over its nodes' GPUs (its placement group waits for them,
    # and each actor sees its one GPU): this host's count bounds the local group only.
    if device == "cuda" and tp * pp > 1 and args.distributed_executor_backend != "ray":
        import torch

        if torch.cuda.device_count() < tp * pp:
            raise ValueError(
                f"tensor_parallel_size {tp} x pipeline_parallel_size {pp} needs {tp * pp} "
                f"GPUs, but torch sees {torch.cuda.device_count()}; lower them"
            )
    _check_data_parallel(args.data_parallel_size, tp, device, pp)


def _check_data_parallel(dp: int, tp: int, device: str, pp: int = 1) -> None:
    """Refuse more replicas than the host can run, before any process starts: on CUDA
    each replica takes its own `tp` x `pp` GPUs; on CPU each needs at least one core."""
    if dp <= 1:
        return
    if device == "cuda":
        import torch

        if torch.cuda.device_count() < dp * tp * pp:
            stages = f" x pipeline_parallel_size {pp}" if pp > 1 else ""
            raise ValueError(
                f"data_parallel_size {dp} x tensor_parallel_size {tp}{stages} needs "
                f"{dp * tp * pp} GPUs, but torch sees {torch.cuda.device_count()}; lower "
                "data_parallel_size")
    else:
        from flowengine.executor.cpu_threads import available_cpus

        if available_cpus() < dp:
            raise ValueError(
                f"data_parallel_size {dp} needs at least {dp} CPU cores (one per replica), "
                f"but {available_cpus()} are available; lower data_parallel_size")


def _check_stages_supported(model_config: Any) -> None:
    """Raise ValueError at start-up (not in the executor processes) for a model family
    whose decoder cannot be split into pipeline stages: the model is built on the
    meta device (no memory) and asked to keep a stage."""
    import torch

    from flowengine.model.models import model_class

    with torch.device("meta"):
        model = model_class(model_config.architecture)(model_config, None)
        keep = getattr(model, "keep_pipeline_stage", None)
        if keep is None:
            raise ValueError(f"pipeline parallelism is not supported for "
                             f"{model_config.architecture} models; serve it with "
                             "pipeline_parallel_size 1")
        keep(0, 1, True, False)  # raises ValueError naming the architecture


def num_kv_blocks_for(resolved: ResolvedEngine, bytes_per_block: int) -> int:
    """KV blocks that fit the budget: `num_kv_blocks`, else `kv_cache_memory_bytes`,
    else the CPU default byte budget (CUDA profiles instead, see _build_cuda_runner).

    Raises ValueError if the budget holds no block (`fit_max_model_len` checks that
    one max_model_len request fits).
    """
    args = resolved.args
    if args.num_kv_blocks is not None:
        return args.num_kv_blocks
    budget = args.kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES
    num_blocks = budget // bytes_per_block
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_memory_bytes={budget} holds no KV block of {bytes_per_block} bytes; "
            "raise it"
        )
    return num_blocks


def fit_max_model_len(resolved: ResolvedEngine, num_kv_blocks: int, *, log: bool = True) -> int:
    """The max_model_len a KV cache of `num_kv_blocks` blocks can serve.

    One sequence of max_model_len tokens must fit the whole KV cache (vLLM refuses to
    start otherwise). A max_model_len the user set is refused when it does not fit;
    one taken from the model's config (not set) is lowered to the KV capacity with a
    warning, so a prompt longer than the cache is a 400 at the edge, never a 5xx.

    Raises ValueError naming the numbers and what to change.
    """
    block_size = resolved.args.block_size
    capacity_tokens = num_kv_blocks * block_size
    if resolved.max_model_len <= capacity_tokens:
        return resolved.max_model_len
    needed_blocks = -(-resolved.max_model_len // block_size)
    if resolved.args.max_model_len is not None:
        raise ValueError(
            f"max_model_len {resolved.max_model_len} needs {needed_blocks} KV blocks of "
            f"{block_size} tokens, but the KV cache holds {num_kv_blocks} blocks "
            f"({capacity_tokens} tokens); lower max_model_len to {capacity_tokens} or less, "
            "or give the KV cache more room (num_kv_blocks, kv_cache_memory_bytes, "
            "gpu_memory_utilization)"
        )
    if log:
        logger.warning(
            "the KV cache holds %d blocks of %d tokens (%d tokens), less than the model's "
            "max_model_len %d: serving with max_model_len %d (set max_model_len, or give "
            "the KV cache more room, to change this)",
            num_kv_blocks, block_size, capacity_tokens, resolved.max_model_len, capacity_tokens,
        )
    return capacity_tokens


def _build_cuda_runner(resolved: ResolvedEngine, bytes_per_block: int,
                       runner_kwargs: dict[str, Any]) -> tuple[Any, CacheConfig]:
    """Load the weights on CUDA, size the KV cache (num_kv_blocks, else
    kv_cache_memory_bytes, else by profiling the largest step against
    gpu_memory_utilization; under tensor parallelism the smallest count of any rank),
    allocate it and capture the decode CUDA graphs.

    Raises ValueError when the budget cannot hold one max_model_len request that the
    user set (`fit_max_model_len`; build_executor checks).
    """
    from flowengine.executor.cuda_runner import CudaModelRunner
    from flowengine.executor.memory_profile import num_kv_blocks_from_profile

    args = resolved.args
    runner = CudaModelRunner(resolved.model_config, None, enforce_eager=args.enforce_eager,
                             **runner_kwargs)
    if args.num_kv_blocks is not None or args.kv_cache_memory_bytes is not None:
        num_blocks = num_kv_blocks_for(resolved, bytes_per_block)
    else:
        profile = runner.profile_memory(args.block_size)
        num_blocks = num_kv_blocks_from_profile(profile, args.gpu_memory_utilization,
                                                bytes_per_block)
        num_blocks = runner.tp.all_reduce_min(num_blocks, runner.device)
    # Every stage's block tables are the same: the smallest count of any rank.
    num_blocks = runner.pp.all_reduce_min(num_blocks, runner.device)
    fit_max_model_len(resolved, num_blocks, log=False)  # before allocating anything
    cache_config = CacheConfig(args.block_size, num_blocks, args.enable_prefix_caching)
    runner.initialize_kv_cache(cache_config)
    runner.capture_cuda_graphs()
    return runner, cache_config


def _kv_sliding_window(resolved: ResolvedEngine) -> int | None:
    """The window the KV cache frees blocks by: the model's, when all layers share it."""
    return getattr(resolved.model_config, "kv_sliding_window", None)


def build_scheduler(resolved: ResolvedEngine, num_blocks: int):
    """The `Scheduler` for a KV cache of `num_blocks` blocks (in the engine process of
    the multiproc placement, from the count its executor reports).

    Its prefix-cache hashes get a fresh secret seed (kv_cache_utils.new_hash_seed): the
    scheduler is the only place that hashes blocks, and a restarted engine process
    starts with an empty cache, so a new seed per scheduler loses no hits.
    """
    from flowengine.core.kv_cache_utils import new_hash_seed
    from flowengine.core.scheduler import Scheduler

    args = resolved.args
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=resolved.max_num_batched_tokens,
            max_model_len=fit_max_model_len(resolved, num_blocks, log=False),
            enable_chunked_prefill=args.enable_chunked_prefill,
            policy=args.scheduling_policy,
        ),
        CacheConfig(args.block_size, num_blocks, args.enable_prefix_caching,
                    sliding_window=_kv_sliding_window(resolved)),
        hash_seed=new_hash_seed(),
        structured_output_manager=make_structured_output_manager(resolved),
        proposer=make_proposer(resolved),
    )
    if args.pipeline_parallel_size > 1:
        # One micro-batch per stage in flight; the stages before the last learn the
        # sampled tokens from the plans (Scheduler.num_micro_batches).
        scheduler.num_micro_batches = args.pipeline_parallel_size
        scheduler.include_new_token_ids = True
    return scheduler


def make_proposer(resolved: ResolvedEngine):
    """The scheduler's draft proposer of `speculative_config` (flowengine/spec_decode),
    or None without speculation."""
    from flowengine.core.spec_tokens import ExecutorDrafts
    from flowengine.spec_decode.config import SpeculativeConfig
    from flowengine.spec_decode.ngram import NgramProposer

    config = SpeculativeConfig.parse(resolved.args.speculative_config)
    if config is None:
        return None
    if config.method == "ngram":
        return NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                             config.prompt_lookup_max)
    return ExecutorDrafts(config.num_speculative_tokens)  # the executor's draft model


def _check_draft_model(args: EngineArgs) -> None:
    """Find speculative_config's draft model before the target loads.

    Raises ValueError naming speculative_config.model when its files cannot be found (a
    missing directory would otherwise surface as FileNotFoundError after the target's
    weights were loaded).
    """
    from flowengine.model.resolve import resolve_model
    from flowengine.spec_decode.config import SpeculativeConfig

    config = SpeculativeConfig.parse(args.speculative_config)
    if config is None or not config.uses_model:
        return
    try:
        resolve_model(config.model, download_dir=args.download_dir)
    except FileNotFoundError as err:
        raise ValueError(f"speculative_config.model: {err}") from None


def _draft_model_config(resolved: ResolvedEngine):
    """The draft model's ModelConfig (speculative_config "model"), or None."""
    from flowengine.model.model_config import ModelConfig
    from flowengine.model.resolve import resolve_model
    from flowengine.spec_decode.config import SpeculativeConfig

    config = SpeculativeConfig.parse(resolved.args.speculative_config)
    if config is None or not config.uses_model:
        return None, None
    args = resolved.args
    path = resolve_model(config.model, download_dir=args.download_dir).path
    if not config.uses_draft_model:  # EAGLE / Medusa heads: their path
        return path, config
    return ModelConfig.from_pretrained(path, resolved.max_model_len), config


def _attach_draft_runner(resolved: ResolvedEngine, runner: Any, draft_config: Any,
                         spec: Any, num_blocks: int) -> None:
    from flowengine.executor.draft_runner import DraftRunner

    args = resolved.args
    if not spec.uses_draft_model:  # draft_config is the head checkpoint's path
        from flowengine.executor.eagle_runner import attach_head_runner

        attach_head_runner(runner, spec.method, draft_config, spec.num_speculative_tokens,
                           num_blocks=num_blocks, block_size=args.block_size,
                           max_num_seqs=args.max_num_seqs)
        return
    runner.draft_runner = DraftRunner(
        draft_config, spec.num_speculative_tokens,
        target_vocab_size=resolved.model_config.vocab_size, num_blocks=num_blocks,
        block_size=args.block_size, max_num_seqs=args.max_num_seqs, device=runner.device,
        dtype=runner.dtype, load_format=args.load_format, seed=args.seed)


def _capture_verification_graphs(resolved: ResolvedEngine, runner: Any) -> None:
    """With speculative decoding on a CUDA runner that captured decode graphs, capture
    the verification graphs of k + 1 tokens per request too (cuda_graphs.py)."""
    from flowengine.spec_decode.config import SpeculativeConfig

    spec = SpeculativeConfig.parse(resolved.args.speculative_config)
    capture = getattr(runner, "capture_verification_graphs", None)
    if spec is not None and capture is not None:
        capture(spec.num_speculative_tokens)


def make_structured_output_manager(resolved: ResolvedEngine):
    """The scheduler's `StructuredOutputManager`: --structured-outputs-backend, the
    model's vocabulary size, and the tokenizer loaded on the first constrained request
    (in a compile thread), so an engine that never sees one never loads it."""
    from flowengine.structured_outputs.manager import StructuredOutputManager

    if resolved.model_config is None:
        return None  # a scheduler built without a model (tests): no vocabulary to mask
    return StructuredOutputManager(
        resolved.args.structured_outputs_backend,
        vocab_size=resolved.model_config.vocab_size,
        tokenizer_loader=lambda: load_engine_tokenizer(resolved),
    )


def build_executor(resolved: ResolvedEngine, tp: Any = None, pp: Any = None):
    """Load weights and allocate the KV cache; return (`Executor`, number of KV blocks).

    tp: this process's TensorParallelGroup (executor processes under tensor
    parallelism); None for a single rank. The runner then holds this rank's shard.
    pp: this process's PipelineStage (flowengine/distributed/pp_group.py); None for
    the whole model. The runner then holds the stage's layers, and every stage gets
    the smallest number of KV blocks any rank's budget holds (block tables are the
    same on all stages).
    Raises ValueError when the KV budget cannot hold one max_model_len request.
    """
    import torch

    from flowengine.distributed.pp_group import SINGLE_STAGE
    from flowengine.distributed.tp_group import SINGLE_RANK
    from flowengine.executor.executor import Executor
    from flowengine.executor.model_runner import ModelRunner

    args = resolved.args
    torch.manual_seed(args.seed)
    dtype = getattr(torch, resolved.dtype)
    tp = SINGLE_RANK if tp is None else tp
    pp = SINGLE_STAGE if pp is None else pp
    kv_dtype = {"auto": dtype, "float16": torch.float16, "bfloat16": torch.bfloat16}.get(
        args.kv_cache_dtype, torch.float8_e4m3fn)
    if resolved.bf16_gemm and args.kv_cache_dtype == "auto":
        # --dtype bfloat16 with quantized weights on the CPU: float32 activations, the
        # KV cache in bf16 (half the bytes each decode step's attention reads)
        kv_dtype = torch.bfloat16
    num_layers = len(pp.layer_range(resolved.model_config.num_layers))
    per_block = ModelRunner.kv_cache_bytes_per_block(resolved.model_config, args.block_size,
                                                     kv_dtype, tp.world_size, num_layers)
    draft_config, spec = _draft_model_config(resolved)
    if draft_config is not None and not spec.uses_draft_model:
        from flowengine.executor.eagle_runner import head_kv_cache_bytes_per_block

        # An EAGLE head's cache has a block for each of the target's, as a draft's.
        per_block += head_kv_cache_bytes_per_block(spec.method, draft_config,
                                                   resolved.model_config, args.block_size,
                                                   dtype)
    elif draft_config is not None:
        from flowengine.executor.draft_runner import DraftRunner

        # The draft's cache has a block for each of the target's: size them together.
        per_block += DraftRunner.kv_cache_bytes_per_block(draft_config, args.block_size, dtype)
    runner_kwargs: dict[str, Any] = dict(
        device=torch.device(resolved.device),
        dtype=dtype,
        load_format=args.load_format,
        model_path=resolved.model_path,
        max_num_batched_tokens=resolved.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        seed=args.seed,
        tp=tp,
        quantization=args.quantization,
        kv_cache_dtype=kv_dtype,
        pp=pp,
    )
    if resolved.device == "cpu":
        from flowengine.executor.cpu_threads import (
            log_bf16_path,
            log_quantized_bf16_path,
            setup_cpu_threads,
        )

        # A multiproc placement leaves a core to the engine and frontend processes;
        # data-parallel replicas share the rest with each other.
        setup_cpu_threads(args.cpu_threads,
                          tp.world_size * pp.size * args.data_parallel_size,
                          reserved_cpus=1 if args.placement == "multiproc" else 0)
        if args.dtype == "bfloat16" and dtype == torch.float32:  # resolve() chose float32
            log_quantized_bf16_path(resolved.bf16_gemm)
        elif dtype == torch.bfloat16:
            log_bf16_path()
    if resolved.model_config.is_encoder_only:
        # No KV tensors (ModelRunner.initialize_kv_cache); eager on every device.
        cache_config = CacheConfig(args.block_size, encoder_num_blocks(resolved), False)
        runner = ModelRunner(resolved.model_config, cache_config, **runner_kwargs)
    elif resolved.device == "cuda":
        runner, cache_config = _build_cuda_runner(resolved, per_block, runner_kwargs)
    else:
        num_blocks = pp.all_reduce_min(num_kv_blocks_for(resolved, per_block),
                                       torch.device(resolved.device))
        cache_config = CacheConfig(args.block_size, num_blocks, args.enable_prefix_caching)
        runner = ModelRunner(resolved.model_config, cache_config, **runner_kwargs)
    if resolved.bf16_gemm:
        from flowengine.model.layers.quant_linear import use_bf16_gemms

        use_bf16_gemms(runner.model)
    # Before the first step, in the process that allocated the cache: a max_model_len
    # the user set that the cache cannot hold stops start-up here with what to change.
    fit_max_model_len(resolved, cache_config.num_blocks, log=False)
    if draft_config is not None:
        _attach_draft_runner(resolved, runner, draft_config, spec, cache_config.num_blocks)
    _capture_verification_graphs(resolved, runner)
    logger.info(
        "executor ready: %s on %s (%s%s), %d KV blocks of %d tokens (KV cache %s)",
        resolved.served_model_names[0],
        resolved.device,
        resolved.dtype,
        f", {args.quantization} weights" if args.quantization else "",
        cache_config.num_blocks,
        args.block_size,
        str(kv_dtype).removeprefix("torch."),
    )
    return Executor(runner, pooler_config=resolved.pooler_config), cache_config.num_blocks


def build_engine_core(resolved: ResolvedEngine):
    """Executor and scheduler in one process (the inproc placement): a ready `EngineCore`."""
    from flowengine.engine.engine_core import EngineCore

    executor, num_blocks = build_executor(resolved)
    return EngineCore(build_scheduler(resolved, num_blocks), executor, resolved.max_model_len)


def load_engine_tokenizer(resolved: ResolvedEngine) -> Any:
    """The tokenizer of `--tokenizer`, else the model's; `trust_remote_code` as given.

    Raises OSError/ValueError as `load_tokenizer` does; ValueError naming
    --trust-remote-code for a tokenizer class of the repository's own code without it.
    """
    from flowengine.tokenize.tokenizer import load_tokenizer

    args = resolved.args
    path = args.tokenizer or resolved.model_path
    try:
        return load_tokenizer(path, trust_remote_code=args.trust_remote_code)
    except OSError as err:
        if args.trust_remote_code or "trust_remote_code" not in str(err):
            raise
        raise ValueError(
            f"the tokenizer of {path} is a class of the model repository's own code (auto_map "
            "in tokenizer_config.json); pass --trust-remote-code (trust_remote_code=True) to "
            "let transformers run it"
        ) from err


def make_input_processor(tokenizer: Any, resolved: ResolvedEngine):
    """The frontend's `InputProcessor` for this model (limits, EOS ids, chat template,
    sampling defaults). Raises ValueError for a bad --chat-template/--generation-config."""
    from flowengine.engine.input_processor import InputProcessor
    from flowengine.model.generation_config import load_generation_defaults
    from flowengine.tokenize.chat import load_chat_template
    from flowengine.tokenize.tokenizer import TokenizerInfo

    args = resolved.args
    info = TokenizerInfo.from_tokenizer(tokenizer, resolved.model_path)
    return InputProcessor(
        tokenizer,
        chat_template=load_chat_template(args.chat_template),
        default_sampling_params=load_generation_defaults(
            resolved.model_path, args.generation_config, args.override_generation_config
        ),
        max_model_len=resolved.max_model_len,
        vocab_size=resolved.model_config.vocab_size,
        eos_token_id=info.eos_token_id,
        extra_eos_token_ids=info.extra_eos_token_ids,
        max_logprobs=resolved.args.max_logprobs,
        structured_outputs_backend=resolved.args.structured_outputs_backend,
        scheduling_policy=resolved.args.scheduling_policy,
        pooler_config=resolved.pooler_config,
        hidden_size=resolved.model_config.hidden_size,
    )
