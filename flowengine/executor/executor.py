"""One executor: model runner + sampler, from a `StepPlan` to a `StepResult`.

The Executor actor (and, in the in-process engine, `EngineCore`) calls
`execute_model`. The sampled tokens are appended to the runner's own copy of each
request, so the next plan needs to carry only deltas (DESIGN.md §2, §5).

`launch(plan)` is the overlapping form, the one the Executor actor uses: it returns
a handle at once and `handle.result()` gives the StepResult later. With a
CudaModelRunner at TP = 1 the step is only enqueued on the device, so a caller can
launch step N+1 before reading step N's result (the scheduler plans N+1 with async
scheduling); other runners, and tensor-parallel rank 0, compute the step before
returning a completed handle. `follow(plan)` is the step of the other
tensor-parallel ranks.

A plan with `pending_structured_output_tokens` (async scheduling with structured
outputs) is launched in two halves: `launch_forward(plan)` runs (or, on the device,
enqueues) the forward, and `launch_sampling(forward, grammar_output)` samples once the
scheduler's `GrammarOutput` for it arrived (vLLM's execute_model / sample_tokens).
"""

from __future__ import annotations

import logging
import traceback
from typing import Any, Protocol

import torch

from flowengine.distributed.pp_group import SINGLE_STAGE
from flowengine.executor.model_runner import ModelOutput, ModelRunner
from flowengine.executor.spec_verify import accept, row_states
from flowengine.messages import GrammarOutput, SampledTokens, StepPlan, StepResult
from flowengine.pooling.config import PoolerConfig
from flowengine.sample.grammar_bitmask import apply_plan_bitmask
from flowengine.sample.sampler import Sampler

logger = logging.getLogger(__name__)


class StepHandle(Protocol):
    """A launched step.

    step_id: the plan's step id. done(): True once result() would not wait for the
    device. result(): waits if need be, then gives the StepResult (idempotent; may
    run in another thread than the next launch).
    """

    step_id: int

    def done(self) -> bool: ...

    def result(self) -> StepResult: ...


def has_drafts(plan: StepPlan) -> bool:
    """Whether any request of the plan carries draft tokens (speculative decoding)."""
    return any(c.draft_token_ids for c in plan.cached_reqs)


class CompletedStep:
    """The handle of a step computed before `launch` returned."""

    def __init__(self, result: StepResult) -> None:
        self.step_id = result.step_id
        self._result = result

    def done(self) -> bool:
        return True

    def result(self) -> StepResult:
        return self._result


class Executor:
    """Runs steps on one device.

    Args:
        runner: holds the weights, the KV cache and per-request token state.
        sampler: turns logits into token ids (and logprobs) on the same device.
        pooler_config: the pooling runner's `PoolerConfig` (flowengine/pooling): every
            step pools its requests' prompts instead of sampling (`pool`); None: the
            generate runner.
    """

    def __init__(self, runner: ModelRunner, sampler: Sampler | None = None,
                 pooler_config: PoolerConfig | None = None) -> None:
        self.runner = runner
        self.sampler = sampler if sampler is not None else Sampler()
        self.pooler_config = pooler_config
        # The runner's pipeline stage (runners that stand in for one in tests have none).
        self.stage = getattr(runner, "pp", SINGLE_STAGE)

    @property
    def launches_on_device(self) -> bool:
        """True when `launch` only enqueues device work and returns without waiting for
        it (a CudaModelRunner at TP = 1 on a CUDA device), so a caller may launch from
        its event loop instead of a worker thread; False when a launch computes the
        step on the host (CPU runners, tensor-parallel rank 0)."""
        return (getattr(self.runner, "launch", None) is not None and self.pooler_config is None
                and self.runner.draft_runner is None
                and self.runner.tp.world_size == 1 and self.runner.device.type == "cuda"
                and self.stage.size == 1)

    def execute_model(self, plan: StepPlan) -> StepResult:
        """Forward and sample one step (the in-process engine's path)."""
        return self.launch(plan).result()

    def launch(self, plan: StepPlan) -> StepHandle:
        """Start one step; plans must be launched in step order.

        Raises ValueError for an inconsistent plan (as execute_model), or one with
        pending_structured_output_tokens (see `launch_forward`), and whatever the
        forward raises. A sampling failure of an already computed step comes back as
        a completed handle whose result has `error` set (under tensor parallelism the
        other ranks are released with a failure mark, see `sample`).
        """
        if self.pooler_config is not None:
            return CompletedStep(self.pool(plan))
        if plan.pending_structured_output_tokens:
            raise ValueError(f"step {plan.step_id} waits for its GrammarOutput: launch it "
                             "with launch_forward, then launch_sampling")
        if self._samples_on_device(plan):
            # (A plan with draft tokens is verified on the host path below: the number of
            # tokens each request gains is known only after sampling.)
            # A runner that samples on the device (CudaModelRunner); tensor-parallel
            # ranks take the path below, where rank 0 shares the sampled tokens.
            return self.runner.launch(plan, self.sampler)
        return self._sample_completed(plan, self.runner.execute_model(plan), plan)

    def _samples_on_device(self, plan: StepPlan) -> bool:
        return (getattr(self.runner, "launch", None) is not None
                and self.runner.tp.world_size == 1 and not has_drafts(plan)
                and self.runner.draft_runner is None and self.stage.size == 1)

    def launch_forward(self, plan: StepPlan) -> Any:
        """The first half of a step: apply the plan and run the forward (on the device:
        enqueue it), up to the logits of the sampling rows. `launch_sampling` must
        follow before the next plan. For plans with pending_structured_output_tokens,
        whose grammar bitmask comes after the forward started; any plan works.

        Returns an opaque forward handle. Raises as `launch`, and ValueError for the
        pooling runner (it never samples).
        """
        if self.pooler_config is not None:
            raise ValueError("the pooling runner has no sampling to defer")
        if self._samples_on_device(plan):
            return self.runner.launch_forward(plan)
        return (plan, self.runner.execute_model(plan))

    def launch_sampling(self, forward: Any, grammar: GrammarOutput | StepPlan) -> StepHandle:
        """The second half of a step: mask the logits of `forward` (from launch_forward)
        with `grammar`'s bitmask (the step's GrammarOutput, or the plan itself), then
        sample as `launch` does. Raises ValueError when `grammar` is another step's."""
        if not isinstance(forward, tuple):  # the device path's LaunchedForward
            return self.runner.launch_sampling(forward, self.sampler, grammar)
        plan, output = forward
        if grammar.step_id != plan.step_id:
            raise ValueError(f"the grammar bitmask of step {grammar.step_id} given to "
                             f"step {plan.step_id}")
        return self._sample_completed(plan, output, grammar)

    def _sample_completed(self, plan: StepPlan, output: ModelOutput,
                          grammar: GrammarOutput | StepPlan) -> CompletedStep:
        try:
            return CompletedStep(self.sample(plan, output, grammar))
        except Exception as exc:
            logger.error("sampling step %d failed: %s", plan.step_id, traceback.format_exc())
            return CompletedStep(
                StepResult(plan.step_id, [], error=f"{type(exc).__name__}: {exc}"))

    def follow(self, plan: StepPlan) -> bool:
        """The step of every rank but the sampling one (tensor-parallel rank 0 of the
        last pipeline stage): the same forward as that rank, then, on the last stage,
        the ids it sampled (`receive_sampled`). A pipeline stage before the last only
        runs its layers and sends its hidden states on (the next plans carry the
        sampled ids, `CachedRequestData.new_token_ids`). Returns False when the
        sampling rank failed to sample the step. Raises as execute_model."""
        if self.pooler_config is not None:  # rank 0 pools and reports; nothing to share
            self.runner.execute_pooling(plan, self.pooler_config.pooling_type)
            return True
        output = self.runner.execute_model(plan)
        if not self.stage.is_last:
            return True
        return self.receive_sampled(plan, output)

    def pool(self, plan: StepPlan) -> StepResult:
        """The pooling runner's step: each scheduled request's whole prompt is computed
        and pooled; its result carries the raw float32 vector (`SampledTokens.pooled`,
        no token), which finishes the request in the scheduler. Raises as
        `ModelRunner.execute_pooling`."""
        assert self.pooler_config is not None
        req_ids, pooled = self.runner.execute_pooling(plan, self.pooler_config.pooling_type)
        rows = pooled.cpu().numpy().astype("<f4", copy=False)  # the step's one host copy
        return StepResult(plan.step_id, [SampledTokens(rid, [], pooled=rows[i].tobytes())
                                         for i, rid in enumerate(req_ids)])

    def sample(self, plan: StepPlan, output: ModelOutput,
               grammar: GrammarOutput | StepPlan | None = None) -> StepResult:
        """Sample the step's logits and append the tokens to the runner's requests.

        grammar: where the step's grammar bitmask is (its GrammarOutput, or the plan,
        the default). Under tensor parallelism this runs on rank 0 and broadcasts the
        sampled ids to the other ranks (`receive_sampled`), so every rank feeds them to
        the next step.
        """
        grammar = plan if grammar is None else grammar
        if not output.req_ids:
            return StepResult(plan.step_id, [])
        if output.draft_token_ids is not None:
            return self._sample_drafts(plan, output, grammar)
        states = [self.runner.get_request_state(rid).sampling_state() for rid in output.req_ids]
        tp = self.runner.tp
        try:
            if output.logits is None:
                raise RuntimeError(f"step {plan.step_id}: no logits on rank {tp.rank}")
            # Structured outputs: disallowed tokens to -inf before sampling and logprobs.
            apply_plan_bitmask(output.logits, output.req_ids,
                               grammar.structured_output_req_ids, grammar.grammar_bitmask)
            sampled = self.sampler(output.logits, states)
        except Exception:
            # The other ranks wait in the broadcast: release them with a failure mark.
            tp.broadcast_from_first(self._failed_ids(len(output.req_ids)))
            raise
        tp.broadcast_from_first(sampled.sampled_token_ids)
        token_ids, logprobs = sampled.tolists()  # the step's one host transfer
        results = []
        for rid, tok, lp in zip(output.req_ids, token_ids, logprobs, strict=True):
            self.runner.append_sampled(rid, [tok])
            prompt_lps = self.runner.get_request_state(rid).take_prompt_logprobs()
            results.append(SampledTokens(rid, [tok], None if lp is None else [lp], prompt_lps))
        self._propose(results)
        return StepResult(plan.step_id, results)

    def _sample_drafts(self, plan: StepPlan, output: ModelOutput,
                       grammar: GrammarOutput | StepPlan) -> StepResult:
        """Sample and verify a step with draft tokens (spec_verify.py): one sampler call
        over every verification row, then each request's accepted tokens."""
        if self.runner.tp.world_size > 1:
            raise RuntimeError("speculative decoding runs at tensor_parallel_size 1 only")
        assert output.logits is not None and output.draft_token_ids is not None
        row_req_ids: list[str] = []
        states = []
        for rid, drafts in zip(output.req_ids, output.draft_token_ids, strict=True):
            rows = row_states(self.runner.get_request_state(rid), drafts)
            states.extend(rows)
            row_req_ids.extend([rid] * len(rows))
        # Constrained requests get no drafts (one row each): their mask rows stay exact.
        apply_plan_bitmask(output.logits, row_req_ids, grammar.structured_output_req_ids,
                           grammar.grammar_bitmask)
        token_ids, logprobs = self.sampler(output.logits, states).tolists()
        results = []
        offset = 0
        for rid, drafts in zip(output.req_ids, output.draft_token_ids, strict=True):
            num_rows = len(drafts) + 1
            tokens, lps = accept(drafts, token_ids[offset:offset + num_rows],
                                 logprobs[offset:offset + num_rows])
            offset += num_rows
            self.runner.apply_verified(rid, tokens)
            prompt_lps = self.runner.get_request_state(rid).take_prompt_logprobs()
            results.append(SampledTokens(rid, tokens, lps, prompt_lps))
        self._propose(results)
        return StepResult(plan.step_id, results)

    def _propose(self, results: list[SampledTokens]) -> None:
        """With a draft model: its drafts after each sampled request's new tokens, in
        the result (the scheduler plans them). Constrained requests get none."""
        draft = self.runner.draft_runner
        if draft is None:
            return
        rows = [r for r in results
                if self.runner.get_request_state(r.req_id).sampling_params.structured_outputs
                is None]
        proposals = draft.propose([self.runner.get_request_state(r.req_id) for r in rows])
        for r, tokens in zip(rows, proposals, strict=True):
            r.draft_token_ids = tokens

    def receive_sampled(self, plan: StepPlan, output: ModelOutput) -> bool:
        """Tensor-parallel ranks other than 0: receive the ids rank 0 sampled for this
        step (`sample` broadcasts them) and append them to the runner's requests.

        Returns False, appending nothing, when rank 0 failed to sample the step (it
        reports the error on the results channel and appends nothing either, so the
        ranks stay in step).
        """
        if not output.req_ids:
            return True
        ids = torch.empty(len(output.req_ids), dtype=torch.int64, device=self.runner.device)
        token_ids = self.runner.tp.broadcast_from_first(ids).tolist()
        if token_ids[0] < 0:
            return False
        for rid, tok in zip(output.req_ids, token_ids, strict=True):
            self.runner.append_sampled(rid, [tok])
        return True

    def _failed_ids(self, num: int) -> torch.Tensor:
        return torch.full((num,), -1, dtype=torch.int64, device=self.runner.device)


class _LastStageStep:
    """A plan launched on the stages before the last of a `LocalPipeline`; result()
    runs it on the last stage (once)."""

    def __init__(self, last: Executor, plan: StepPlan) -> None:
        self.step_id = plan.step_id
        self._last = last
        self._plan: StepPlan | None = plan
        self._result: StepResult | None = None

    def done(self) -> bool:
        return self._result is not None

    def result(self) -> StepResult:
        if self._result is None:
            assert self._plan is not None
            self._result = self._last.launch(self._plan).result()
            self._plan = None
        return self._result


class LocalPipeline:
    """The executors of every stage of one pipeline in this process (their runners'
    stages from `pp_group.local_pipeline`, joined by in-memory pipes), as one executor:
    tests, and the one-GPU check of the CUDA stage path.

    `launch(plan)` runs the plan on every stage before the last at once (as their
    executor processes would: `follow`, hidden states sent on) and returns a handle
    whose result() runs the last stage and samples. A caller that launches micro-batch
    N + 1 before reading N's result gets the stage processes' order (stage 0 on N + 1
    while the last stage is on N); results must be read in launch order.

    Raises ValueError unless executors[i] runs stage i of len(executors).
    """

    def __init__(self, executors: list[Executor]) -> None:
        ranks = [(e.stage.rank, e.stage.size) for e in executors]
        if ranks != [(i, len(executors)) for i in range(len(executors))]:
            raise ValueError(f"LocalPipeline needs stage i of {len(executors)} at index i, "
                             f"got (rank, size) {ranks}")
        self.executors = executors
        self.stage = executors[-1].stage
        self.runner = executors[-1].runner

    def launch(self, plan: StepPlan) -> StepHandle:
        for executor in self.executors[:-1]:
            executor.follow(plan)
        return _LastStageStep(self.executors[-1], plan)

    def execute_model(self, plan: StepPlan) -> StepResult:
        return self.launch(plan).result()
