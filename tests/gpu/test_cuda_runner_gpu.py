"""CudaModelRunner on the GPU: pinned double-buffered staging copies, CUDA-graph decode
against the eager forward, KV-cache sizing by profiling, and sampling features with
two steps in flight against one step at a time.

Uses the small random Llama-3-style model of gpu_models.py (bf16).
Run: pytest -s tests/gpu/test_cuda_runner_gpu.py
"""

from __future__ import annotations

import gc
import os
from collections import deque
from collections.abc import Iterator

import numpy as np
import pytest
import torch

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("needs CUDA with compiled Triton kernels", allow_module_level=True)

from gpu_models import logits_error, save_model, shared_prefix_prompts  # noqa: E402

from flowengine import LLM  # noqa: E402
from flowengine.config import CacheConfig  # noqa: E402
from flowengine.executor.cuda_runner import CudaModelRunner  # noqa: E402
from flowengine.executor.staging_buffer import StagingBuffers  # noqa: E402
from flowengine.messages import (  # noqa: E402
    CachedRequestData,
    NewRequest,
    NewRequestData,
    StepPlan,
)
from flowengine.model.model_config import ModelConfig  # noqa: E402
from flowengine.sampling_params import SamplingParams  # noqa: E402

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("llama3"))
    save_model("llama3", path, seed=7)
    return path


def test_staging_buffers_are_pinned_and_double_buffered() -> None:
    regions = {"a": (np.int64, torch.int64, 1 << 20), "b": (np.int32, torch.int32, 3)}
    buffers = StagingBuffers(regions, CUDA)
    assert all(h.is_pinned() for h in buffers._hosts) and len(buffers._hosts) == 2
    first = buffers.next_host()
    first["a"][:] = 1
    first["b"][:] = [1, 2, 3]
    buffers.copy_to_device(buffers.total_bytes)
    copied = buffers.dev["a"].clone()  # stream-ordered after the copy
    second = buffers.next_host()
    assert second["a"].ctypes.data != first["a"].ctypes.data
    second["a"][:] = 2  # must not race with the first copy: it used the other buffer
    second["b"][:] = [4, 5, 6]
    buffers.copy_to_device(buffers.total_bytes)
    torch.cuda.synchronize()
    assert bool((copied == 1).all()) and bool((buffers.dev["a"] == 2).all())
    assert buffers.dev["b"].tolist() == [4, 5, 6]
    third = buffers.next_host()  # waits for the first copy, then reuses its buffer
    assert third["a"].ctypes.data == first["a"].ctypes.data


def _run_plans(runner: CudaModelRunner, prompts: list[list[int]]) -> torch.Tensor:
    """Prefill each prompt (chunks of <= 256 tokens), then one decode step of all:
    returns the decode logits [len(prompts), vocab]."""
    params = SamplingParams(temperature=0.0)
    step, blocks = 0, 0
    for i, prompt in enumerate(prompts):
        ids = list(range(blocks, blocks + len(prompt) // 16 + 2))
        blocks += len(ids)
        runner.execute_model(StepPlan(step, [NewRequestData(str(i), prompt, len(prompt), params,
                                                            ids, 0)], [], [min(256, len(prompt))]))
        step += 1
        for done in range(256, len(prompt), 256):
            runner.execute_model(StepPlan(step, [], [CachedRequestData(str(i), [], done)],
                                          [min(256, len(prompt) - done)]))
            step += 1
        runner.append_sampled(str(i), [prompt[0]])
    cached = [CachedRequestData(str(i), [], len(p)) for i, p in enumerate(prompts)]
    out = runner.execute_model(StepPlan(step, [], cached, [1] * len(prompts)))
    assert out.req_ids == [str(i) for i in range(len(prompts))]
    return out.logits


def test_graph_decode_matches_eager_decode(model_path: str) -> None:
    config = ModelConfig.from_pretrained(model_path, 1024)
    prompts = [p[:600] for p in shared_prefix_prompts(3)[::5]][:5]  # decode batch 5 -> graph 8
    logits = {}
    for eager in (True, False):
        runner = CudaModelRunner(config, CacheConfig(16, 256), CUDA, torch.bfloat16,
                                 max_num_batched_tokens=256, max_num_seqs=8,
                                 enforce_eager=eager, capture_sizes=(1, 2, 4, 8))
        runner.capture_cuda_graphs()
        assert (runner.graphs is None) == eager
        logits[eager] = _run_plans(runner, prompts)
        del runner
    for i in range(len(prompts)):
        err = logits_error(logits[False][i], logits[True][i])
        assert err[0] <= 0.25 and err[1] <= 0.05, f"request {i}: {err}"
    assert torch.equal(logits[False].argmax(-1), logits[True].argmax(-1))


def test_kv_cache_sized_by_profiling(model_path: str) -> None:
    total = torch.cuda.mem_get_info()[1]
    llm = LLM(model_path, dtype="bfloat16", device="cuda", max_model_len=1024,
              max_num_batched_tokens=512, gpu_memory_utilization=0.3, placement="inproc")
    try:
        runner = llm.engine.executor.runner
        num_blocks = runner.cache_config.num_blocks
        per_block = runner.kv_cache_bytes_per_block(runner.model_config, 16, torch.bfloat16)
        print(f"profiled KV cache: {num_blocks} blocks, {num_blocks * per_block / 2**30:.2f} GiB")
        assert runner.kv_caches[0].shape[1] == num_blocks
        assert num_blocks * per_block > 0.1 * total  # most of the 30% goes to the cache
        assert torch.cuda.memory_allocated() <= 0.3 * total + (1 << 30)
        out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def _mixed_requests(prompts: list[list[int]], prefix: str) -> list[NewRequest]:
    kinds = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=9, repetition_penalty=1.3,
                       frequency_penalty=0.5, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=7, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=11, max_tokens=10,
                       ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=5, min_tokens=3, ignore_eos=True),
    ]
    return [NewRequest(f"{prefix}{i}", p, kinds[i % len(kinds)], 0.0)
            for i, p in enumerate(prompts)]


def _drive(llm: LLM, msgs: list[NewRequest], max_in_flight: int) -> list[list[int]]:
    """Token ids per request (in `msgs` order), with up to max_in_flight steps launched."""
    engine = llm.engine
    for msg in msgs:
        engine.add_request(msg)
    engine.scheduler.async_scheduling = max_in_flight > 1
    tokens: dict[str, list[int]] = {m.request_id: [] for m in msgs}
    in_flight: deque = deque()
    try:
        while engine.scheduler.has_unfinished_requests() or in_flight:
            while len(in_flight) < max_in_flight:
                plan = engine.scheduler.schedule()
                if not plan.num_scheduled_tokens:
                    break  # its finished ids come again in the next plan
                in_flight.append((plan, engine.executor.launch(plan)))
            if not in_flight:
                raise RuntimeError("unfinished requests but nothing schedulable")
            plan, handle = in_flight.popleft()
            result = handle.result()
            assert result.error is None, result.error
            if plan.num_scheduled_tokens:
                for delta in engine.scheduler.update_from_output(plan, result):
                    tokens[delta.req_id].extend(delta.new_token_ids)
    finally:
        engine.scheduler.async_scheduling = False
    return [tokens[m.request_id] for m in msgs]


@pytest.fixture(scope="module")
def small_llm(model_path: str) -> Iterator[LLM]:
    llm = LLM(model_path, dtype="bfloat16", device="cuda", max_model_len=1024,
              max_num_batched_tokens=256, max_num_seqs=16, num_kv_blocks=2048,
              placement="inproc")  # the tests drive its engine core
    yield llm
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def test_sampling_features_with_two_steps_in_flight(small_llm: LLM) -> None:
    """Penalties (which read token values and so wait for the earlier step), logprobs,
    seeded sampling and min_tokens give the same tokens with steps overlapped."""
    prompts = [p[:300] for p in shared_prefix_prompts(5)[:20]]
    sync = _drive(small_llm, _mixed_requests(prompts, "sync-"), 1)
    overlapped = _drive(small_llm, _mixed_requests(prompts, "overlap-"), 2)
    assert overlapped == sync
    assert small_llm.engine.executor.runner.num_pending_steps == 0


def _mixed_plans(seed: int, prompts: list[list[int]], budget: int, shared: int):
    """Plans of random mixed steps: each step decodes every prefilled request and
    gives the rest of the budget to prefill chunks of random length (requests arrive
    over time); requests 1.. reuse request 0's first `shared` tokens from the prefix
    cache (their blocks, num_computed_tokens = shared) once request 0 has computed them.
    Yields (plan, request indices in plan order) lazily: the caller appends the
    sampled ids before asking for the next plan."""
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=0.0)
    blocks_of: dict[int, list[int]] = {}
    computed: dict[int, int] = {}
    next_block = 0
    waiting = list(range(len(prompts)))
    step = 0
    while waiting or any(computed[i] < len(prompts[i]) + 6 for i in computed):
        new, cached, num = [], [], []
        left = budget
        for i in sorted(computed):
            total = len(prompts[i]) + 6  # 6 decode steps after the prompt
            if computed[i] >= total or left == 0:
                continue
            if computed[i] >= len(prompts[i]):
                n = 1
            else:
                n = int(min(left, len(prompts[i]) - computed[i], rng.integers(1, 97)))
            cached.append(CachedRequestData(str(i), [], computed[i]))
            num.append(n)
            left -= n
        while waiting and left > 0 and rng.random() < 0.7:
            i = waiting[0]
            if i > 0 and 0 not in computed:
                break
            if i > 0 and computed[0] < shared:
                break
            waiting.pop(0)
            prompt = prompts[i]
            start = shared if i > 0 else 0
            own = -(-(len(prompt) + 8) // 16) - start // 16
            ids = (blocks_of[0][:start // 16] if start else []) + list(
                range(next_block, next_block + own))
            next_block += own
            blocks_of[i] = ids
            n = int(min(left, len(prompt) - start, rng.integers(1, 129)))
            new.append(NewRequestData(str(i), prompt, len(prompt), params, ids, start))
            computed[i] = start
            num.append(n)
            left -= n
        if not num:
            continue
        # num holds the cached requests' counts, then the new ones'; a plan lists
        # new_reqs first.
        order = [int(r.req_id) for r in new] + [int(c.req_id) for c in cached]
        plan = StepPlan(step, new, cached, num[len(cached):] + num[:len(cached)])
        for i, n in zip(order, plan.num_scheduled_tokens, strict=True):
            computed[i] += n
        step += 1
        yield plan, order


@pytest.mark.parametrize("seed", [0, 1])
def test_mixed_step_graphs_match_eager(model_path: str, seed: int) -> None:
    """Random mixes of prefill chunks (lengths 1..128), prefix-cache hits and decodes:
    the mixed-step CUDA graphs (padded to a token count, unified attention kernel)
    give the eager forward's logits and greedy ids on every step."""
    config = ModelConfig.from_pretrained(model_path, 1024)
    prompts = [p[:200 + 37 * i] for i, p in enumerate(shared_prefix_prompts(3)[:7])]
    runners = {}
    for eager in (True, False):
        runner = CudaModelRunner(config, CacheConfig(16, 512), CUDA, torch.bfloat16,
                                 max_num_batched_tokens=256, max_num_seqs=8,
                                 enforce_eager=eager, capture_sizes=(1, 2, 4, 8))
        runner.capture_cuda_graphs()
        runners[eager] = runner
    graphs = runners[False].mixed_graphs
    assert graphs is not None and runners[False].mixed_sizes[-1] == 256
    replayed: list[int] = []
    replay = graphs.replay
    graphs.replay = lambda size: replayed.append(size) or replay(size)  # type: ignore[method-assign]
    num_steps = 0
    for plan, _ in _mixed_plans(seed, prompts, 256, 64):
        outs = {eager: r.execute_model(plan) for eager, r in runners.items()}
        assert outs[True].req_ids == outs[False].req_ids
        if not outs[True].req_ids:
            continue
        for row in range(len(outs[True].req_ids)):
            err = logits_error(outs[False].logits[row], outs[True].logits[row])
            assert err[0] <= 0.25 and err[1] <= 0.05, f"step {plan.step_id} row {row}: {err}"
        ids = outs[True].logits.argmax(-1).tolist()
        assert outs[False].logits.argmax(-1).tolist() == ids, f"step {plan.step_id}"
        for r in runners.values():
            for rid, tok in zip(outs[True].req_ids, ids, strict=True):
                r.append_sampled(rid, [tok])
        num_steps += 1
    mixed = replayed
    print(f"seed {seed}: {num_steps} sampled steps, mixed replays at sizes {sorted(set(mixed))}")
    assert len(mixed) >= 5
    del runners
    gc.collect()
    torch.cuda.empty_cache()


def test_device_timers_time_each_launched_step(small_llm: LLM,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """With FLOWENGINE_DEVICE_TIMERS a launched step carries (start, end) timing events:
    start after its inputs' copy, end after its tokens' copy; without, none."""
    import flowengine.executor.cuda_runner as cuda_runner

    engine = small_llm.engine
    prompts = [p[:200] for p in shared_prefix_prompts(2)[:4]]
    for timed in (True, False):
        monkeypatch.setattr(cuda_runner, "DEVICE_TIMERS", timed)
        for msg in _mixed_requests(prompts, f"timers-{timed}-")[:4]:
            engine.add_request(msg)
        handles = []
        for _ in range(10_000):  # bounded: an empty plan with requests left must not spin
            if not engine.scheduler.has_unfinished_requests():
                break
            plan = engine.scheduler.schedule()
            assert plan.num_scheduled_tokens, "unfinished requests but nothing schedulable"
            handle = engine.executor.launch(plan)
            result = handle.result()
            assert result.error is None, result.error
            handles.append(handle)
            engine.scheduler.update_from_output(plan, result)
        else:
            raise AssertionError("the requests did not finish in 10,000 steps")
        sampled = [h for h in handles if h.req_ids]
        assert sampled
        for handle in sampled:
            events = handle.device_events
            if not timed:
                assert events is None
                continue
            start, end = events
            elapsed_ms = start.elapsed_time(end)
            assert 0.0 < elapsed_ms < 10_000.0, elapsed_ms
