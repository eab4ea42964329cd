"""One executor: model runner + sampler, from a `StepPlan` to a `StepResult`.

The Executor actor (and, in the in-process engine, `EngineCore`) calls
`execute_model`. The sampled tokens are appended to the runner's own copy of each
request, so the next plan needs to carry only deltas (DESIGN.md §2, §5).
"""

from __future__ import annotations

from flowengine.executor.model_runner import ModelOutput, ModelRunner
from flowengine.messages import SampledTokens, StepPlan, StepResult
from flowengine.sample.sampler import Sampler, SamplingState


class Executor:
    """Runs steps on one device.

    Args:
        runner: holds the weights, the KV cache and per-request token state.
        sampler: turns logits into token ids (and logprobs) on the same device.
    """

    def __init__(self, runner: ModelRunner, sampler: Sampler | None = None) -> None:
        self.runner = runner
        self.sampler = sampler if sampler is not None else Sampler()

    def execute_model(self, plan: StepPlan) -> StepResult:
        """Forward and sample one step (the in-process engine's path)."""
        return self.sample(plan, self.runner.execute_model(plan))

    def sample(self, plan: StepPlan, output: ModelOutput) -> StepResult:
        """Sample the step's logits and append the tokens to the runner's requests."""
        if not output.req_ids:
            return StepResult(plan.step_id, [])
        states = []
        for rid in output.req_ids:
            st = self.runner.get_request_state(rid)
            states.append(
                SamplingState(
                    sampling_params=st.sampling_params,
                    prompt_token_ids=st.token_ids[: st.num_prompt_tokens],
                    output_token_ids=st.token_ids[st.num_prompt_tokens :],
                    eos_token_id=st.eos_token_id,
                )
            )
        sampled = self.sampler(output.logits, states)
        token_ids, logprobs = sampled.tolists()  # the step's one host transfer
        results = []
        for rid, tok, lp in zip(output.req_ids, token_ids, logprobs, strict=True):
            self.runner.append_sampled(rid, [tok])
            results.append(SampledTokens(rid, [tok], None if lp is None else [lp]))
        return StepResult(plan.step_id, results)
