"""Pipeline parallelism on CUDA (issue 18): the CUDA stage path of CudaModelRunner.

One H200 is one GPU, and NCCL refuses two ranks on one device, so
(a) runs two stage executors in ONE process on cuda:0 (stage 0: embedding and layers
0-1; stage 1: layers 2-3, final norm, LM head, sampling), the hidden states handed
over by a device copy (`LocalPipelineStage`), the engine's scheduler keeping two
micro-batches in flight, and checks PP = 1's greedy ids (CUDA graphs on) in bf16 with
chunked prefill and prefix caching; plus each stage's memory profile;
(b) the real two-process run over NCCL (`pipeline_parallel_size=2`, one GPU per rank,
the KV cache sized by each stage's profile) skips with fewer than two GPUs (issue 19
runs it on a multi-GPU machine).

Uses a 4-layer random-weight Llama-3-style model of gpu_models.py, saved with
transformers. Run: pytest -s tests/gpu/test_pp_gpu.py
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("needs CUDA with compiled Triton kernels", allow_module_level=True)

from gpu_models import save_model, shared_prefix_prompts  # noqa: E402
from pp_drive import generate_in_flight  # noqa: E402

from flowengine import LLM  # noqa: E402
from flowengine.config import EngineArgs  # noqa: E402
from flowengine.distributed.pp_group import local_pipeline  # noqa: E402
from flowengine.engine.builder import (  # noqa: E402
    build_engine_core,
    build_executor,
    build_scheduler,
    resolve,
)
from flowengine.engine.engine_core import EngineCore  # noqa: E402
from flowengine.executor.cuda_runner import CudaModelRunner  # noqa: E402
from flowengine.executor.executor import LocalPipeline  # noqa: E402
from flowengine.executor.memory_profile import num_kv_blocks_from_profile  # noqa: E402
from flowengine.sampling_params import SamplingParams  # noqa: E402

pytestmark = pytest.mark.gpu

ENGINE = dict(device="cuda", dtype="bfloat16", max_model_len=1024, max_num_batched_tokens=256,
              max_num_seqs=32, num_kv_blocks=1024, enable_prefix_caching=True,
              enable_chunked_prefill=True, seed=0)
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("llama3-pp"))
    save_model("llama3", path, seed=5, num_hidden_layers=4)
    return path


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def test_two_stages_in_one_process_equal_pp1(model_path: str) -> None:
    resolved = resolve(EngineArgs(model=model_path, **ENGINE))
    prompts = shared_prefix_prompts(5)
    whole = build_engine_core(resolved)  # PP = 1, decode in CUDA graphs
    assert whole.executor.runner.graphs is not None
    reference, _ = generate_in_flight(whole, whole.executor, prompts, GREEDY, 1)
    assert len({tuple(r) for r in reference}) > len(prompts) // 2  # not degenerate
    del whole
    _free()

    stages = local_pipeline(resolved.model_config.num_layers, 2)
    executors = [build_executor(resolved, None, stage)[0] for stage in stages]
    for executor, stage in zip(executors, stages, strict=True):
        runner = executor.runner
        assert type(runner) is CudaModelRunner and runner.device.type == "cuda"
        assert runner.pp is stage and len(runner.kv_caches) == 2
        assert runner.graphs is None  # stages run eagerly
        assert not executor.launches_on_device  # the last stage samples on the host path
    pipeline = LocalPipeline(executors)
    scheduler = build_scheduler(resolved, ENGINE["num_kv_blocks"])
    scheduler.num_micro_batches = 2  # what build_scheduler sets at PP = 2
    scheduler.include_new_token_ids = True
    core = EngineCore(scheduler, pipeline, resolved.max_model_len)
    got, seen = generate_in_flight(core, pipeline, prompts, GREEDY, 2)
    mismatched = [i for i, (g, r) in enumerate(zip(got, reference, strict=True)) if g != r]
    assert not mismatched, f"requests {mismatched} differ from PP = 1"
    assert seen["max_in_flight"] == 2  # two micro-batches overlapped
    assert seen["partial_prefills"] > 0 and seen["cached_tokens"] > 0
    assert not any(stages[0].pipes.values())  # every hidden state was consumed
    del executors, pipeline, core
    _free()


def test_each_stage_profiles_its_own_part(model_path: str) -> None:
    resolved = resolve(EngineArgs(model=model_path, **ENGINE))
    config = resolved.model_config
    for stage in local_pipeline(config.num_layers, 2):
        runner = CudaModelRunner(config, None, torch.device("cuda"), torch.bfloat16,
                                 max_num_batched_tokens=256, max_num_seqs=32, pp=stage)
        weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        profile = runner.profile_memory(16)
        per_block = runner.kv_cache_bytes_per_block(config, 16, torch.bfloat16, 1, 2)
        blocks = num_kv_blocks_from_profile(profile, 0.5, per_block)
        print(f"stage {stage.rank}: weights {weights / 2**20:.0f} MiB, peak "
              f"{profile.peak_torch_bytes / 2**20:.0f} MiB, {blocks} KV blocks at 0.5")
        assert weights <= profile.peak_torch_bytes < weights + (1 << 30)
        assert blocks > 0
        del runner
        _free()


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="the two-process NCCL run needs two GPUs (issue 19); one GPU "
                           "runs both stages in one process above")
def test_pp2_over_nccl_equals_pp1(model_path: str) -> None:
    engine = {k: v for k, v in ENGINE.items() if k != "num_kv_blocks"}

    def greedy(**kwargs: object) -> list[list[int]]:
        # The KV cache sized by profiling: each stage's profile, then the smallest count.
        llm = LLM(model_path, **engine, gpu_memory_utilization=0.5, **kwargs)
        try:
            outs = llm.generate(shared_prefix_prompts(5), GREEDY, use_tqdm=False)
        finally:
            llm.shutdown()
        _free()
        return [list(o.outputs[0].token_ids) for o in outs]

    reference = greedy()
    assert greedy(pipeline_parallel_size=2) == reference
    assert greedy(pipeline_parallel_size=2, enforce_eager=True) == reference
