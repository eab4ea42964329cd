"""Pipeline stages in one process (`LocalPipelineStage`, `LocalPipeline`): the engine's
scheduler with two micro-batches in flight over stage executors joined by in-memory
pipes gives PP = 1's greedy ids with chunked prefill and prefix caching, with the CPU
`ModelRunner` and with `CudaModelRunner` (its stage path, run on the CPU here; on the
GPU in tests/gpu/test_pp_gpu.py). Plus the CUDA-only pieces that need no GPU: the GPU
index of each rank, the start-up checks, the stage's memory-profile model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from pp_drive import generate_in_flight

from flowengine.config import CacheConfig, EngineArgs
from flowengine.distributed.pp_group import LocalPipelineStage, local_pipeline
from flowengine.engine.builder import build_engine_core, build_scheduler, resolve
from flowengine.engine.engine_core import EngineCore
from flowengine.executor.cuda_runner import CudaModelRunner
from flowengine.executor.cuda_stage import StageProfileModel, local_gpu_index
from flowengine.executor.executor import Executor, LocalPipeline
from flowengine.executor.model_runner import ModelRunner
from flowengine.messages import StepPlan
from flowengine.sampling_params import SamplingParams

ENGINE = dict(device="cpu", dtype="float32", max_model_len=256, max_num_batched_tokens=32,
              max_num_seqs=8, num_kv_blocks=96, block_size=16, enable_prefix_caching=True,
              enable_chunked_prefill=True, seed=0)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def prompts() -> list[list[int]]:
    """Six prompts: four share a 40-token prefix (two blocks and more: prefix-cache hits
    once the first has computed it), four are longer than the 32-token step budget
    (chunked prefill)."""
    g = torch.Generator().manual_seed(3)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, 40000, (n,), generator=g).tolist()

    prefix = tokens(40)
    return [prefix + tokens(n) for n in (5, 9, 17, 30)] + [tokens(7), tokens(50)]


def _stage_executor(resolved, stage: LocalPipelineStage, runner_cls: type) -> Executor:
    config = resolved.model_config
    cache_config = CacheConfig(16, ENGINE["num_kv_blocks"], True)
    deferred = runner_cls is CudaModelRunner  # as _build_cuda_runner: KV cache later
    runner = runner_cls(config, None if deferred else cache_config,
                        torch.device("cpu"), torch.float32, "safetensors",
                        max_num_batched_tokens=32, max_num_seqs=8, pp=stage)
    if deferred:
        assert runner.pp.all_reduce_min(ENGINE["num_kv_blocks"], runner.device) \
            == ENGINE["num_kv_blocks"]
        runner.initialize_kv_cache(cache_config)
        runner.capture_cuda_graphs()  # a no-op for a stage (and on the CPU)
        assert runner.graphs is None
    return Executor(runner)


@pytest.mark.parametrize("runner_cls", [ModelRunner, CudaModelRunner])
def test_local_pipeline_equals_one_stage(tiny_llama: str, runner_cls: type) -> None:
    resolved = resolve(EngineArgs(model=tiny_llama, **ENGINE))
    whole = build_engine_core(resolved)
    reference, _ = generate_in_flight(whole, whole.executor, prompts(), GREEDY, 1)
    assert len({tuple(r) for r in reference}) == len(reference)  # not degenerate

    stages = local_pipeline(resolved.model_config.num_layers, 2)
    assert [(s.start_layer, s.end_layer) for s in stages] == [(0, 2), (2, 4)]
    executors = [_stage_executor(resolved, s, runner_cls) for s in stages]
    assert [len(e.runner.kv_caches) for e in executors] == [2, 2]
    pipeline = LocalPipeline(executors)
    scheduler = build_scheduler(resolved, ENGINE["num_kv_blocks"])
    scheduler.num_micro_batches = 2  # what build_scheduler sets at PP = 2
    scheduler.include_new_token_ids = True
    core = EngineCore(scheduler, pipeline, resolved.max_model_len)
    got, seen = generate_in_flight(core, pipeline, prompts(), GREEDY, 2)
    assert got == reference
    assert seen["max_in_flight"] == 2  # two micro-batches overlapped
    assert seen["partial_prefills"] > 0 and seen["cached_tokens"] > 0
    assert not any(stages[0].pipes.values())  # every hidden state was consumed
    if runner_cls is CudaModelRunner:
        with pytest.raises(ValueError, match="a pipeline stage runs its steps through "
                                             "execute_model"):
            executors[-1].runner.launch(StepPlan(99, [], [], []), executors[-1].sampler)


def test_local_stage_errors() -> None:
    first, second = local_pipeline(4, 2)
    with pytest.raises(RuntimeError, match="stage 1 receives before stage 0 sent"):
        second.recv_prev((2, 3, 8), torch.float32, torch.device("cpu"))
    first.send_next(torch.zeros(2, 3, 8))
    with pytest.raises(RuntimeError, match=r"expected \(2, 4, 8\) torch.float32 from stage 0, "
                                           r"got \(2, 3, 8\)"):
        second.recv_prev((2, 4, 8), torch.float32, torch.device("cpu"))
    assert first.all_reduce_min(7, torch.device("cpu")) == 7
    with pytest.raises(ValueError, match="LocalPipeline needs stage i of 2 at index i"):
        LocalPipeline([_FakeExecutor(second), _FakeExecutor(first)])


class _FakeExecutor:
    def __init__(self, stage: LocalPipelineStage) -> None:
        self.stage = stage
        self.runner = None


def test_each_rank_drives_its_own_gpu() -> None:
    # dp_rank, tp, pp, rank, visible -> index
    assert local_gpu_index(0, 1, 2, 1, 2) == 1
    assert local_gpu_index(1, 2, 2, 3, 8) == 7
    assert local_gpu_index(0, 1, 2, 1, 1) == 0  # a Ray actor given one GPU
    with pytest.raises(ValueError, match=r"executor rank 2 of data-parallel replica 0 needs "
                                         r"GPU 2 \(tensor_parallel_size 1 x "
                                         r"pipeline_parallel_size 4 GPUs per replica\), but "
                                         r"torch sees 2 GPUs"):
        local_gpu_index(0, 1, 4, 2, 2)


def test_cuda_pipeline_is_accepted_when_the_gpus_exist(tiny_llama: str, monkeypatch) -> None:
    from flowengine.engine.builder import _check_tensor_parallel

    config = resolve(EngineArgs(model=tiny_llama, **ENGINE)).model_config
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    _check_tensor_parallel(EngineArgs(pipeline_parallel_size=2), config, "cuda")
    with pytest.raises(ValueError, match="tensor_parallel_size 2 x pipeline_parallel_size 2 "
                                         "needs 4 GPUs, but torch sees 2"):
        _check_tensor_parallel(EngineArgs(tensor_parallel_size=2, pipeline_parallel_size=2),
                               config, "cuda")
    # Ray places the ranks on its nodes' GPUs; a Ray actor process sees its one GPU.
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    ray_args = SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=2,
                               data_parallel_size=1, distributed_executor_backend="ray")
    _check_tensor_parallel(ray_args, config, "cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    with pytest.raises(ValueError, match="data_parallel_size 2 x tensor_parallel_size 1 x "
                                         "pipeline_parallel_size 4 needs 8 GPUs, but torch "
                                         "sees 4"):
        _check_tensor_parallel(EngineArgs(pipeline_parallel_size=4, data_parallel_size=2),
                               config, "cuda")


def test_stage_profile_model_runs_the_stage_part(tiny_llama: str) -> None:
    from flowengine.executor.memory_profile import _dummy_metadata

    config = resolve(EngineArgs(model=tiny_llama, **ENGINE)).model_config
    stages = local_pipeline(config.num_layers, 2)
    for stage in stages:
        runner = ModelRunner(config, None, torch.device("cpu"), torch.float32, "safetensors",
                             pp=stage)
        model = StageProfileModel(runner.model, stage, config.hidden_size, torch.float32)
        kv = [torch.zeros(2, 1, 16, config.num_kv_heads, config.head_dim) for _ in range(2)]
        meta = _dummy_metadata([12], 16, torch.device("cpu"))
        out = model(torch.zeros(12, dtype=torch.int64), torch.arange(12), kv, meta)
        if stage.is_last:
            assert out.shape == (12, config.hidden_size)
            assert model.compute_logits(out[:3]).shape == (3, config.vocab_size)
        else:
            assert out.shape == (2, 12, config.hidden_size)
            assert model.compute_logits(out[:3]) is None
