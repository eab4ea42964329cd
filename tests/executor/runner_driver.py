"""A tiny scheduler stand-in for tests: builds StepPlans, samples greedily.

It follows the scheduler's side of the StepPlan protocol (flowengine/messages.py):
token budget per step with chunked prefill, blocks taken from a shuffled free list
(so block ids are not contiguous), requests sent in full once and as deltas after,
finished ids announced in the next plan, preemption as a resend in full.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from flowengine.executor.model_runner import ModelRunner
from flowengine.messages import CachedRequestData, NewRequestData, StepPlan
from flowengine.sampling_params import SamplingParams


@dataclass
class _Seq:
    req_id: str
    prompt: list[int]
    max_new_tokens: int
    outputs: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    sent: bool = False  # the runner holds it (else the next plan sends it in full)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.outputs

    @property
    def done(self) -> bool:
        return len(self.outputs) >= self.max_new_tokens


class GreedyDriver:
    """Drives a ModelRunner to greedy completions of several prompts at once.

    token_budget: max tokens per step (small values force chunked prefill).
    preempt: {req_id: step} - at that step the request loses its blocks and is resent
    in full later (recompute).
    """

    def __init__(self, runner: ModelRunner, token_budget: int, seed: int = 0,
                 preempt: dict[str, int] | None = None) -> None:
        self.runner = runner
        self.block_size = runner.cache_config.block_size
        self.token_budget = token_budget
        self.free_blocks = list(range(runner.cache_config.num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.preempt = dict(preempt or {})
        self.step_id = 0
        self.partial_chunks = 0  # steps where a request computed without sampling
        self.num_preemptions = 0

    def generate(self, prompts: dict[str, list[int]], max_new_tokens: int
                 ) -> dict[str, _Seq]:
        seqs = {rid: _Seq(rid, list(p), max_new_tokens) for rid, p in prompts.items()}
        finished: list[str] = []
        while not all(s.done for s in seqs.values()):
            plan = self._plan([s for s in seqs.values() if not s.done], finished)
            finished = []
            out = self.runner.execute_model(plan)
            assert out.logits.shape == (len(out.req_ids), self.runner.model_config.vocab_size)
            assert out.logits.dtype == torch.float32
            sampled = set(out.req_ids)
            for rid in plan.scheduled_req_ids:
                seq = seqs[rid]
                if rid not in sampled:
                    self.partial_chunks += 1
                    continue
                token = int(out.logits[out.req_ids.index(rid)].argmax())
                seq.logits.append(out.logits[out.req_ids.index(rid)].clone())
                seq.outputs.append(token)
                self.runner.append_sampled(rid, [token])
                if seq.done:
                    finished.append(rid)
                    self.free_blocks.extend(seq.block_ids)
            self.step_id += 1
        if finished:
            self.runner.execute_model(StepPlan(self.step_id, [], [], [], finished))
        return seqs

    def _plan(self, active: list[_Seq], finished: list[str]) -> StepPlan:
        for seq in active:
            if self.preempt.get(seq.req_id) == self.step_id and seq.sent:
                self.free_blocks.extend(seq.block_ids)
                seq.block_ids, seq.num_computed, seq.sent = [], 0, False
                self.num_preemptions += 1
                finished.append(seq.req_id)  # the runner drops it, then gets it anew
        new_reqs: list[NewRequestData] = []
        cached: list[CachedRequestData] = []
        new_counts: list[int] = []
        cached_counts: list[int] = []
        budget = self.token_budget
        for seq in active:
            num = min(len(seq.tokens) - seq.num_computed, budget)
            if num == 0:
                continue
            budget -= num
            need = -(-(seq.num_computed + num) // self.block_size) - len(seq.block_ids)
            new_blocks = [self.free_blocks.pop() for _ in range(need)]
            seq.block_ids.extend(new_blocks)
            if not seq.sent:
                new_reqs.append(NewRequestData(
                    seq.req_id, seq.tokens, len(seq.prompt), SamplingParams(temperature=0.0),
                    list(seq.block_ids), seq.num_computed))
                new_counts.append(num)
                seq.sent = True
            else:
                cached.append(CachedRequestData(seq.req_id, new_blocks, seq.num_computed))
                cached_counts.append(num)
            seq.num_computed += num
        return StepPlan(self.step_id, new_reqs, cached, new_counts + cached_counts, finished)
