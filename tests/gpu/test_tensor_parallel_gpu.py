"""Tensor parallelism over NCCL (issue 6): TP=2 gives TP=1's greedy tokens, with CUDA
graphs (the all-reduces captured) and eagerly, on a random-weight Llama-3-style model
saved with transformers (tests/gpu/gpu_models.py). Needs two GPUs.

The Llama-3.1-8B-shaped comparison and the latency/throughput figures are
benchmarks/tp_bench.py (docs/benchmarks.md).
"""

from __future__ import annotations

import os

import pytest
import torch

if (not torch.cuda.is_available() or torch.cuda.device_count() < 2
        or os.environ.get("TRITON_INTERPRET") == "1"):
    pytest.skip("needs two CUDA GPUs with compiled Triton kernels", allow_module_level=True)

from gpu_models import save_model, shared_prefix_prompts  # noqa: E402

from flowengine import LLM, SamplingParams  # noqa: E402

pytestmark = pytest.mark.gpu

ENGINE_ARGS = dict(dtype="bfloat16", device="cuda", max_model_len=1024, placement="multiproc",
                   max_num_batched_tokens=256, max_num_seqs=64, num_kv_blocks=2048, seed=0)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("llama3-tp"))
    save_model("llama3", path, seed=11)
    return path


def _greedy(path: str, **kwargs: object) -> list[list[int]]:
    llm = LLM(path, **{**ENGINE_ARGS, **kwargs})
    try:
        outs = llm.generate(shared_prefix_prompts(11), SamplingParams(
            temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


def test_tp2_equals_tp1_with_graphs_and_eagerly(model_path: str) -> None:
    reference = _greedy(model_path, tensor_parallel_size=1)
    assert _greedy(model_path, tensor_parallel_size=2) == reference
    assert _greedy(model_path, tensor_parallel_size=2, enforce_eager=True) == reference
