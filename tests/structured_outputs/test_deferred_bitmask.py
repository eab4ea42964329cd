"""Async scheduling with structured outputs through real executors: a plan whose
constrained requests sample on placeholder tokens (pending_structured_output_tokens)
has its forward launched first and is sampled with the `GrammarOutput` the scheduler
fills after the previous step's result (vLLM's execute_model / sample_tokens split).

A tiny random Llama on the CPU and a stand-in grammar manager whose rule depends on
the whole accepted history (so a mask filled one token early would be wrong): the
CudaModelRunner (token slots on the device, placeholders on the host) with two steps
in flight must give exactly the tokens of the plain ModelRunner stepping one plan at a
time, every token must obey the rule, and constrained requests must sample in every
step.
"""

from __future__ import annotations

from collections import deque

import anyio
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from flowengine.actors.executor import ExecutorActor
from flowengine.config import CacheConfig, SchedulerConfig
from flowengine.core.scheduler import Scheduler
from flowengine.executor.cuda_runner import CudaModelRunner
from flowengine.executor.executor import CompletedStep, Executor
from flowengine.executor.model_runner import ModelRunner
from flowengine.messages import (
    GrammarOutput,
    NewRequest,
    NewRequestData,
    Shutdown,
    StepPlan,
    StepResult,
)
from flowengine.model.model_config import ModelConfig
from flowengine.request import Request
from flowengine.sample.sampler import Sampler
from flowengine.sampling_params import SamplingParams, StructuredOutputsParams
from flowengine.shm.inproc import InprocChannel
from flowengine.structured_outputs.backend import bitmask_words

CPU = torch.device("cpu")
VOCAB = 128


def allowed_tokens(history: list[int]) -> list[int]:
    """The stand-in grammar: 5 tokens allowed after `history`, a function of all of it."""
    h = sum((i + 1) * t for i, t in enumerate(history)) % VOCAB
    return sorted({(h + 37 * k) % VOCAB for k in range(5)})


class RuleManager:
    """The scheduler's side of a `StructuredOutputManager` (the methods it calls), with
    `allowed_tokens` as every request's grammar; ready at once."""

    def __init__(self) -> None:
        self.history: dict[str, list[int]] = {}
        self.num_compiling = 0
        self.num_fills = 0

    def add_request(self, request: Request) -> None:
        if request.sampling_params.structured_outputs is not None:
            self.history[request.request_id] = list(request.output_token_ids)

    def poll(self, request: Request) -> str | None:
        return None

    def has_matcher(self, request_id: str) -> bool:
        return request_id in self.history

    @property
    def num_matchers(self) -> int:
        return len(self.history)

    def fill_bitmask(self, request_ids: list[str]) -> bytes:
        self.num_fills += 1
        bitmask = torch.zeros(len(request_ids), bitmask_words(VOCAB), dtype=torch.int32)
        for row, rid in enumerate(request_ids):
            for t in allowed_tokens(self.history[rid]):
                bitmask[row, t // 32] |= (1 << (t % 32)) - (1 << 32 if t % 32 == 31 else 0)
        return bitmask.numpy().tobytes()

    def accept_tokens(self, request_id: str, token_ids: list[int]) -> bool:
        history = self.history.get(request_id)
        if history is None:
            return True
        for t in token_ids:
            if t not in allowed_tokens(history):
                return False
            history.append(t)
        return True

    def remove(self, request_id: str) -> None:
        self.history.pop(request_id, None)

    def wait_for_compiles(self, timeout_s: float) -> None:
        pass


@pytest.fixture(scope="module")
def model_config(tmp_path_factory: pytest.TempPathFactory) -> ModelConfig:
    path = str(tmp_path_factory.mktemp("tiny"))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=96, initializer_range=0.2, eos_token_id=None,
                      bos_token_id=None)
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return ModelConfig.from_pretrained(path)


def _requests() -> list[NewRequest]:
    so = StructuredOutputsParams(regex=".*")  # the stand-in manager ignores the spec
    params = [
        SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, structured_outputs=so),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=7, logprobs=2, ignore_eos=True,
                       structured_outputs=so),
        SamplingParams(temperature=0.9, seed=3, max_tokens=10, ignore_eos=True,
                       structured_outputs=so),
    ]
    return [NewRequest(str(i), [(7 * i + 3 * j + 1) % VOCAB for j in range(5 + i)], p, 0.0)
            for i, p in enumerate(params)]


def _generate(executor: Executor, max_in_flight: int):
    """The Scheduler and Executor actors' loops, synchronously: a pending plan's forward
    is launched with the plan, its sampling after the previous result was applied."""
    manager = RuleManager()
    scheduler = Scheduler(SchedulerConfig(8, 64, 96), CacheConfig(4, 60),
                          async_scheduling=max_in_flight > 1, structured_output_manager=manager)
    for msg in _requests():
        scheduler.add_request(Request.from_new_request(msg, 96))
    tokens: dict[str, list[int]] = {}
    plans: list[StepPlan] = []
    in_flight: deque = deque()  # [plan, forward or None, handle or None]
    while scheduler.has_unfinished_requests() or in_flight:
        while len(in_flight) < max_in_flight:
            plan = scheduler.schedule()
            if not plan.num_scheduled_tokens:
                break
            plans.append(plan)
            if plan.pending_structured_output_tokens:
                with pytest.raises(ValueError, match="waits for its GrammarOutput"):
                    executor.launch(plan)  # refused before it touches any state
                in_flight.append([plan, executor.launch_forward(plan), None])
            else:
                in_flight.append([plan, None, executor.launch(plan)])
        plan, _, handle = in_flight.popleft()
        for delta in scheduler.update_from_output(plan, handle.result()):
            assert delta.error is None, delta.error
            tokens.setdefault(delta.req_id, []).extend(delta.new_token_ids)
        for grammar in scheduler.take_grammar_outputs():
            entry = in_flight[0]
            assert entry[0].step_id == grammar.step_id and entry[2] is None
            with pytest.raises(ValueError, match="grammar bitmask of step"):
                executor.launch_sampling(entry[1], GrammarOutput(grammar.step_id + 1))
            entry[2] = executor.launch_sampling(entry[1], grammar)
        assert not in_flight or in_flight[0][2] is not None
    return tokens, plans


def test_two_steps_in_flight_with_pending_bitmasks_match_one_step_at_a_time(
        model_config: ModelConfig) -> None:
    sync_runner = ModelRunner(model_config, CacheConfig(4, 60), CPU, torch.float32,
                              max_num_batched_tokens=64, max_num_seqs=8)
    expected, sync_plans = _generate(Executor(sync_runner, Sampler(seed=1)), 1)
    assert not any(p.pending_structured_output_tokens for p in sync_plans)
    lengths = {"0": 9, "1": 12, "2": 7, "3": 10}
    assert {rid: len(t) for rid, t in expected.items()} == lengths
    # Every constrained token obeys the rule given its own history.
    prompts = {m.request_id: m.prompt_token_ids for m in _requests()}
    for rid in ("0", "2", "3"):
        for i, t in enumerate(expected[rid]):
            assert t in allowed_tokens(expected[rid][:i]), (rid, i)
    # ... and the rule changed greedy's choice (the mask did something).
    free = ModelRunner(model_config, CacheConfig(4, 60), CPU, torch.float32,
                       max_num_batched_tokens=64, max_num_seqs=8)
    out = free.execute_model(StepPlan(0, [_new_data(prompts["0"])], [], [len(prompts["0"])]))
    assert int(out.logits[0].argmax()) not in allowed_tokens([])

    for runner_cls in (CudaModelRunner, ModelRunner):
        runner = runner_cls(model_config, CacheConfig(4, 60), CPU, torch.float32,
                            max_num_batched_tokens=64, max_num_seqs=8)
        tokens, plans = _generate(Executor(runner, Sampler(seed=1)), 2)
        assert tokens == expected, runner_cls.__name__
        # Constrained requests sampled in every step from their first token to their
        # last: one plan per token, plus the speculative one when they ended (by
        # max_tokens here: none). All start in the first plan (the prefill, its bitmask
        # in the plan); each later plan with one of them had its bitmask sent after it.
        for rid in ("0", "2", "3"):
            steps = [i for i, p in enumerate(plans) if rid in p.scheduled_req_ids]
            assert steps == list(range(lengths[rid])), (rid, steps)
        assert [p.pending_structured_output_tokens for p in plans] == (
            [False] + [True] * (lengths["3"] - 1) + [False] * (lengths["1"] - lengths["3"]))


def _new_data(prompt: list[int]) -> NewRequestData:
    return NewRequestData("x", prompt, len(prompt), SamplingParams(temperature=0.0), [0, 1],
                          0)


class _ScriptedExecutor:
    """Records the calls of the Executor actor; step results are complete at once."""

    def __init__(self, fail_forward: set[int]) -> None:
        self.runner = self
        self.tp = type("Tp", (), {"rank": 0, "world_size": 1})()
        self.log: list[str] = []
        self.fail_forward = fail_forward

    def launch(self, plan: StepPlan):
        self.log.append(f"launch {plan.step_id}")
        return CompletedStep(StepResult(plan.step_id, []))

    def launch_forward(self, plan: StepPlan):
        self.log.append(f"forward {plan.step_id}")
        if plan.step_id in self.fail_forward:
            raise RuntimeError(f"forward of step {plan.step_id} failed")
        return plan.step_id

    def launch_sampling(self, forward: int, grammar: GrammarOutput):
        self.log.append(f"sample {forward} with {grammar.structured_output_req_ids}")
        return CompletedStep(StepResult(forward, []))


def _plan(step_id: int, pending: bool = False) -> StepPlan:
    return StepPlan(step_id, [], [], [], pending_structured_output_tokens=pending)


def test_the_executor_actor_samples_a_pending_plan_with_its_grammar_output() -> None:
    async def main() -> None:
        executor = _ScriptedExecutor(fail_forward={2})
        steps, results = InprocChannel(), InprocChannel()
        actor = ExecutorActor(executor, steps, results, blocking=_inline)
        async with anyio.create_task_group() as tg:
            tg.start_soon(actor.run)
            await steps.send_async(_plan(0))
            await steps.send_async(_plan(1, pending=True))
            # Step 0's result goes out while step 1 (forward launched) waits.
            with anyio.fail_after(30):
                assert (await results.recv_async()).step_id == 0
            await anyio.sleep(0.05)
            assert executor.log == ["launch 0", "forward 1"] and results.try_recv() is None
            await steps.send_async(GrammarOutput(1, ["a"], b"\0" * 4))
            with anyio.fail_after(30):
                assert (await results.recv_async()).step_id == 1
            # A failed forward: its GrammarOutput is still taken, the step gets the error.
            await steps.send_async(_plan(2, pending=True))
            await steps.send_async(GrammarOutput(2))
            await steps.send_async(_plan(3))
            with anyio.fail_after(30):
                failed, ok = await results.recv_async(), await results.recv_async()
            assert (failed.step_id, failed.error) == (2, "RuntimeError: forward of step 2 failed")
            assert (ok.step_id, ok.error) == (3, None)
            # Shutdown while a step waits for its bitmask stops the actor.
            await steps.send_async(_plan(4, pending=True))
            await steps.send_async(Shutdown())
        assert executor.log == ["launch 0", "forward 1", "sample 1 with ['a']", "forward 2",
                                "launch 3", "forward 4"]

    anyio.run(main)


def test_the_executor_actor_refuses_a_grammar_output_of_another_step() -> None:
    async def main() -> None:
        actor = ExecutorActor(_ScriptedExecutor(set()), steps := InprocChannel(),
                              InprocChannel(), blocking=_inline)
        await steps.send_async(_plan(5, pending=True))
        await steps.send_async(GrammarOutput(6))
        with pytest.raises(BaseExceptionGroup) as info, anyio.fail_after(30):
            await actor.run()
        assert "step 5 waits for its grammar bitmask, got GrammarOutput 6" in str(
            info.value.exceptions[0])

    anyio.run(main)


async def _inline(fn, *args):
    return fn(*args)
