"""The CUDA executor's logic, checked on the CPU: graph batch-size padding, KV-cache
sizing math, staging-buffer packing, placeholders gathered from the device, and a
CudaModelRunner with two steps in flight and padded decode batches against the plain
ModelRunner (same tokens, same logprobs). CUDA graphs themselves run in tests/gpu."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from flowengine.config import CacheConfig, SchedulerConfig
from flowengine.core.scheduler import Scheduler
from flowengine.executor.cuda_graphs import (
    CAPTURE_SIZES,
    DecodeCudaGraphs,
    capture_sizes_for,
    mixed_capture_sizes,
    padded_batch_size,
)
from flowengine.executor.cuda_runner import CudaModelRunner
from flowengine.executor.executor import Executor
from flowengine.executor.input_batch import PLACEHOLDER_TOKEN_ID, InputBatch, RequestState
from flowengine.executor.memory_profile import MemoryProfile, num_kv_blocks_from_profile
from flowengine.executor.model_runner import ModelRunner
from flowengine.executor.staging_buffer import StagingBuffers, buffer_layout
from flowengine.messages import NewRequest, TokenLogprobs
from flowengine.model.model_config import ModelConfig
from flowengine.request import Request
from flowengine.sample.sampler import Sampler
from flowengine.sampling_params import SamplingParams

CPU = torch.device("cpu")
BLOCK = 4


def test_capture_sizes_are_vllms_list_cut_at_the_limits() -> None:
    assert CAPTURE_SIZES[:6] == (1, 2, 4, 8, 16, 24) and CAPTURE_SIZES[-1] == 512
    assert len(CAPTURE_SIZES) == 67
    assert capture_sizes_for(256, 2048) == [1, 2, 4, *range(8, 257, 8)]
    assert capture_sizes_for(100, 2048)[-2:] == [96, 104]  # the first size covering 100
    assert capture_sizes_for(1000, 8192)[-1] == 512
    assert capture_sizes_for(256, 20) == [1, 2, 4, 8, 16]  # capped by the token budget
    assert capture_sizes_for(3, 2048) == [1, 2, 4]


def test_padded_batch_size_is_the_nearest_captured_size() -> None:
    sizes = capture_sizes_for(512, 8192)
    expected = {1: 1, 2: 2, 3: 4, 4: 4, 5: 8, 8: 8, 9: 16, 17: 24, 100: 104, 511: 512, 512: 512}
    assert {n: padded_batch_size(n, sizes) for n in expected} == expected
    assert padded_batch_size(513, sizes) is None
    assert padded_batch_size(3, []) is None


def test_graphs_need_fixed_buffers_and_ascending_sizes() -> None:
    batch = InputBatch(block_size=BLOCK, max_blocks_per_req=3, device=CPU)
    with pytest.raises(ValueError, match="non-growable InputBatch"):
        DecodeCudaGraphs(torch.nn.Identity(), [], batch, object(), 64, [1, 2])
    batch.growable = False
    with pytest.raises(ValueError, match="ascending and distinct"):
        DecodeCudaGraphs(torch.nn.Identity(), [], batch, object(), 64, [2, 1])


def test_kv_blocks_from_the_profiled_peak() -> None:
    gib = 2**30
    profile = MemoryProfile(total_bytes=80 * gib, peak_torch_bytes=17 * gib,
                            non_torch_bytes=gib // 2)
    # 0.9 * 80 GiB - 17 GiB - 0.5 GiB = 54.5 GiB, in 2 MiB blocks.
    assert num_kv_blocks_from_profile(profile, 0.9, 2 * 2**20) == 27904
    with pytest.raises(ValueError, match="raise gpu_memory_utilization"):
        num_kv_blocks_from_profile(profile, 0.2, 2 * 2**20)


def test_staging_regions_round_trip() -> None:
    regions = {"a": (np.int64, torch.int64, 3), "b": (np.int32, torch.int32, 5),
               "c": (np.int32, torch.int32, 2)}
    offsets, total = buffer_layout(regions)
    assert offsets == {"a": (0, 24), "b": (24, 20), "c": (48, 8)} and total == 56
    buffers = StagingBuffers(regions, CPU)
    host = buffers.next_host()
    host["a"][:] = [-1, 2**40, 7]
    host["b"][:] = np.arange(5) - 2
    host["c"][:] = [9, -9]
    buffers.copy_to_device(total)
    assert buffers.dev["a"].tolist() == [-1, 2**40, 7]
    assert buffers.dev["b"].tolist() == [-2, -1, 0, 1, 2]
    assert buffers.dev["c"].tolist() == [9, -9]
    assert buffers.host_tensor("b", 2).tolist() == [-2, -1]


def _state(req_id: str, tokens: list[int], blocks: list[int], computed: int,
           slot: int = -1) -> RequestState:
    return RequestState(req_id, tokens, 2, SamplingParams(), None, blocks, computed,
                        token_slot=slot)


def test_decode_step_padded_for_a_graph() -> None:
    batch = InputBatch(block_size=BLOCK, max_blocks_per_req=3, device=CPU, max_num_tokens=8,
                       max_num_reqs=8, growable=False)
    a = _state("a", [5, 6, 7, 8, 9], [4, 1], computed=4, slot=2)
    b = _state("b", [1, 2, 3], [6], computed=2, slot=0)
    c = _state("c", [3, 3, 3, 3, 3, 3], [2, 7], computed=5, slot=5)
    inputs = batch.prepare([a, b, c], [1, 1, 1], pad_to=4)
    meta = inputs.attn_metadata
    assert inputs.input_ids.tolist() == [9, 3, 3, 0]
    assert inputs.positions.tolist() == [4, 2, 5, 0]
    assert meta.slot_mapping.tolist() == [1 * 4 + 0, 6 * 4 + 2, 7 * 4 + 1, -1]
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 3]  # the padding request is empty
    assert meta.seq_lens.tolist() == [5, 3, 6, 0]
    assert meta.block_tables.tolist() == [[4, 1, 0], [6, 0, 0], [2, 7, 0], [0, 0, 0]]
    assert (meta.max_query_len, meta.max_seq_len) == (1, 6)
    assert inputs.logits_indices.tolist() == [0, 1, 2]
    assert inputs.sample_slots.tolist() == [2, 0, 5]
    assert inputs.gather_dst is None and (inputs.num_tokens, inputs.num_reqs) == (3, 3)
    with pytest.raises(ValueError, match="exceeds the input buffers"):
        batch.prepare([a, b, c], [1, 1, 1], pad_to=16)


def test_placeholder_inputs_are_gathered_from_token_slots() -> None:
    batch = InputBatch(block_size=BLOCK, max_blocks_per_req=4, device=CPU)
    a = _state("a", [5, 6, 7, PLACEHOLDER_TOKEN_ID], [3], computed=3, slot=6)
    a.placeholder_indices.append(3)
    b = _state("b", [1, 2, 3, 4, 5], [0, 2], computed=0, slot=1)
    inputs = batch.prepare([b, a], [5, 1])
    assert inputs.input_ids.tolist() == [1, 2, 3, 4, 5, PLACEHOLDER_TOKEN_ID]
    assert inputs.gather_dst.tolist() == [5] and inputs.gather_src.tolist() == [6]
    assert inputs.sample_req_ids == ["b", "a"] and inputs.sample_slots.tolist() == [1, 6]

    # An older placeholder than the latest cannot be computed: its value is gone.
    a.token_ids.append(PLACEHOLDER_TOKEN_ID)
    a.placeholder_indices.append(4)
    a.block_ids.append(5)
    with pytest.raises(ValueError, match="superseded by token 4"):
        batch.prepare([a], [2])


@pytest.fixture(scope="module")
def model_config(tmp_path_factory: pytest.TempPathFactory) -> ModelConfig:
    path = str(tmp_path_factory.mktemp("tiny"))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=96,
                      initializer_range=0.2, eos_token_id=None, bos_token_id=None)
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return ModelConfig.from_pretrained(path)


def _requests() -> list[NewRequest]:
    prefix = [(5 * i + 1) % 128 for i in range(13)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 9, 6)]
    params += [
        SamplingParams(temperature=0.0, max_tokens=7, repetition_penalty=1.5, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=5, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0.9, top_k=20, seed=7, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=4, min_tokens=2, ignore_eos=True),
    ]
    return [
        NewRequest(str(i), prefix + [(11 * i + j) % 128 for j in range(i % 3 + 1)], p, 0.0)
        for i, p in enumerate(params)
    ]


def _generate(executor: Executor, max_in_flight: int
              ) -> tuple[dict[str, list[int]], dict[str, list[TokenLogprobs]], int]:
    """The scheduler loop with up to `max_in_flight` launched steps (the Scheduler
    actor's loop, synchronously): outputs, logprobs, prefix-cache hits."""
    scheduler = Scheduler(SchedulerConfig(8, 12, 96), CacheConfig(BLOCK, 40),
                          async_scheduling=max_in_flight > 1)
    for msg in _requests():
        scheduler.add_request(Request.from_new_request(msg, 96))
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[TokenLogprobs]] = {}
    in_flight: deque = deque()
    while scheduler.has_unfinished_requests() or in_flight:
        while len(in_flight) < max_in_flight:
            plan = scheduler.schedule()
            if not plan.num_scheduled_tokens:
                break  # its finished ids come again in the next plan
            in_flight.append((plan, executor.launch(plan)))
        if not in_flight:
            raise RuntimeError("unfinished requests but nothing schedulable")
        plan, handle = in_flight.popleft()
        result = handle.result()
        for sampled in result.sampled:
            logprobs.setdefault(sampled.req_id, []).extend(sampled.logprobs or [])
        if plan.num_scheduled_tokens:
            for delta in scheduler.update_from_output(plan, result):
                tokens.setdefault(delta.req_id, []).extend(delta.new_token_ids)
    return tokens, logprobs, scheduler.prefix_cache_hits


@pytest.fixture(scope="module")
def reference(model_config: ModelConfig
              ) -> tuple[dict[str, list[int]], dict[str, list[TokenLogprobs]]]:
    """Outputs of the plain ModelRunner, one step at a time."""
    runner = ModelRunner(model_config, CacheConfig(BLOCK, 40), CPU, torch.float32,
                         max_num_batched_tokens=12, max_num_seqs=8)
    tokens, logprobs, hits = _generate(Executor(runner, Sampler(seed=1)), 1)
    assert hits > 0  # the shared prefix is a prefix-cache hit
    return tokens, logprobs


def test_two_steps_in_flight_with_padded_decode_match_the_sync_runner(
        model_config: ModelConfig, reference: tuple) -> None:
    expected, expected_lp = reference
    cache = CacheConfig(BLOCK, 40)
    runner = CudaModelRunner(model_config, cache, CPU, torch.float32,
                             max_num_batched_tokens=12, max_num_seqs=8)
    runner.decode_batch_sizes = [1, 2, 4]  # pads decode steps of 3 to 4; 5+ run unpadded
    prepare = runner.input_batch.prepare
    steps: list[tuple[int | None, bool]] = []

    def spy(states: list[RequestState], num: list[int], *, pad_to: int | None = None):
        inputs = prepare(states, num, pad_to=pad_to)
        steps.append((pad_to, inputs.gather_dst is not None))
        return inputs

    runner.input_batch.prepare = spy  # type: ignore[method-assign]
    tokens, logprobs, _ = _generate(Executor(runner, Sampler(seed=1)), 2)
    assert tokens == expected
    lengths = {"0": 3, "1": 9, "2": 6, "3": 7, "4": 5, "5": 8, "6": 4}
    assert {rid: len(t) for rid, t in tokens.items()} == lengths
    assert (4, True) in steps and (None, True) in steps  # padded, and device-fed inputs
    assert runner.num_pending_steps == 0
    assert len(logprobs["4"]) == 5
    for got, want in zip(logprobs["4"], expected_lp["4"], strict=True):
        assert got.top_token_ids == want.top_token_ids
        assert got.sampled_rank == want.sampled_rank
        np.testing.assert_allclose(got.top_logprobs, want.top_logprobs, rtol=1e-5, atol=1e-6)


def test_triton_backend_skips_padding_requests(model_config: ModelConfig,
                                               reference: tuple) -> None:
    """The Triton kernels (interpreted on the CPU) on padded decode steps, with the
    split-KV decode kernel forced as in a captured graph: same tokens as the torch
    reference backend."""
    from flowengine.model.attention.triton_backend import TritonAttentionBackend

    runner = CudaModelRunner(model_config, CacheConfig(BLOCK, 40), CPU, torch.float32,
                             attn_backend=TritonAttentionBackend(num_kv_splits=2),
                             max_num_batched_tokens=12, max_num_seqs=8)
    runner.decode_batch_sizes = [1, 2, 4, 8]
    tokens, _, _ = _generate(Executor(runner, Sampler(seed=1)), 2)
    assert tokens == reference[0]


def test_cuda_runner_takes_every_model_runner_argument() -> None:
    """The builder passes the same keyword arguments to ModelRunner and CudaModelRunner
    (engine/builder.py `runner_kwargs`): a ModelRunner parameter that CudaModelRunner
    lacks breaks every CUDA start-up (`pp` did, after pipeline parallelism)."""
    import inspect

    from flowengine.executor.model_runner import ModelRunner

    base = set(inspect.signature(ModelRunner.__init__).parameters)
    cuda = set(inspect.signature(CudaModelRunner.__init__).parameters)
    assert base - cuda == set()


def test_mixed_capture_sizes_cover_every_step_up_to_the_token_budget() -> None:
    sizes = mixed_capture_sizes(256, 2048)
    assert sizes[:4] == [2, 4, 8, 16] and 512 in sizes
    assert [s for s in sizes if 512 < s <= 1024] == list(range(576, 1025, 64))
    assert [s for s in sizes if s > 1024] == list(range(1152, 2049, 128))
    assert mixed_capture_sizes(8, 12) == [2, 4, 8, 12]
    assert mixed_capture_sizes(256, 700) == [*[s for s in CAPTURE_SIZES if 2 <= s <= 512],
                                             576, 640, 700]
    for budget in (12, 700, 2048, 8192):
        sizes = mixed_capture_sizes(256, budget)
        assert sizes == sorted(set(sizes)) and sizes[-1] == budget
        for n in range(2, budget + 1):
            padded = padded_batch_size(n, sizes)
            assert padded is not None and n <= padded
            assert padded - n < max(64, n // 4)  # padding stays a small fraction


def _mixed_spy(runner: CudaModelRunner) -> list[tuple[int, int | None, int | None, int]]:
    """Record (tokens, pad_to, pad_reqs_to, longest) of every prepared step."""
    prepare = runner.input_batch.prepare
    steps: list[tuple[int, int | None, int | None, int]] = []

    def spy(states: list[RequestState], num: list[int], *, pad_to: int | None = None,
            pad_reqs_to: int | None = None):
        steps.append((sum(num), pad_to, pad_reqs_to, max(num)))
        return prepare(states, num, pad_to=pad_to, pad_reqs_to=pad_reqs_to)

    runner.input_batch.prepare = spy  # type: ignore[method-assign]
    return steps


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_padded_mixed_steps_match_the_sync_runner(model_config: ModelConfig,
                                                  reference: tuple, backend: str) -> None:
    """Mixed steps (chunked prefill, prefix-cache hits, decodes) padded as for the
    mixed CUDA graphs: tokens padded to a mixed size, requests to min(size,
    max_num_seqs). With the Triton backend (interpreted on the CPU) in `unified_only`
    mode, as captured: every attention is the unified kernel over padded requests;
    same tokens as the plain runner."""
    kwargs = {}
    if backend == "triton":
        from flowengine.model.attention.triton_backend import TritonAttentionBackend

        attn = TritonAttentionBackend(num_kv_splits=2)
        attn.unified_only = True
        kwargs["attn_backend"] = attn
    runner = CudaModelRunner(model_config, CacheConfig(BLOCK, 40), CPU, torch.float32,
                             max_num_batched_tokens=12, max_num_seqs=8, **kwargs)
    runner.decode_batch_sizes = [1, 2, 4, 8]
    runner.mixed_sizes = mixed_capture_sizes(8, 12)
    steps = _mixed_spy(runner)
    tokens, _, _ = _generate(Executor(runner, Sampler(seed=1)), 2)
    assert tokens == reference[0]
    mixed = [s for s in steps if s[3] > 1]
    assert mixed and all(pad_to == padded_batch_size(n, runner.mixed_sizes)
                         and pad_reqs == min(pad_to, 8) for n, pad_to, pad_reqs, _ in mixed)
    assert any(pad_to > n for n, pad_to, _, _ in mixed)  # some were padded
