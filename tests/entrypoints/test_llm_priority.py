"""LLM.generate's `priority` list: one entry per prompt, checked before any prompt."""

from __future__ import annotations

import pytest

from flowengine import LLM, SamplingParams


class _CountingProcessor:
    """Stands in for the input processor: counts the prompts it is given."""

    def __init__(self) -> None:
        self.num_processed = 0

    def process(self, *args, **kwargs):
        self.num_processed += 1
        raise AssertionError("no prompt may be processed when priority is refused")


@pytest.mark.parametrize("priority", [[0], [0, 1, 2]])
def test_priority_of_the_wrong_length_is_a_value_error(priority):
    llm = LLM.__new__(LLM)  # no model: the check comes before any prompt is touched
    llm.input_processor = _CountingProcessor()
    with pytest.raises(ValueError, match=f"got {len(priority)} priorities for 2 prompts"):
        llm.generate(["a", "b"], priority=priority, use_tqdm=False)
    assert llm.input_processor.num_processed == 0


def test_multiproc_llm_passes_each_prompt_priority_to_submit():
    """The multiproc `LLM` (the CUDA default) hands each prompt's priority to
    `AsyncEngine.submit`, with FINAL_ONLY outputs, results in prompt order."""
    from flowengine.entrypoints.llm_multiproc import BackgroundEngine
    from flowengine.sampling_params import RequestOutputKind

    seen: list[tuple[str, int, RequestOutputKind]] = []

    class FakeEngine:
        max_queue_len = 8

        async def start(self) -> None:
            pass

        async def shutdown(self, drain_timeout_s: float = 0.0) -> None:
            pass

        async def _outputs(self, request_id: str):
            yield f"out-{request_id}"

        def submit(self, prompt, params, request_id, *, priority=0, output_kind=None):
            seen.append((request_id, priority, output_kind))
            return self._outputs(request_id)

    background = BackgroundEngine(FakeEngine())
    try:
        done: list[int] = []
        jobs = [({"prompt_token_ids": [1, 2]}, None, f"r{i}", p)
                for i, p in enumerate([5, 0, -3])]
        outs = background.generate(jobs, lambda: done.append(1))
    finally:
        background.close()
    assert outs == ["out-r0", "out-r1", "out-r2"] and len(done) == 3
    assert sorted(seen) == [("r0", 5, RequestOutputKind.FINAL_ONLY),
                            ("r1", 0, RequestOutputKind.FINAL_ONLY),
                            ("r2", -3, RequestOutputKind.FINAL_ONLY)]


@pytest.mark.slow
def test_a_non_zero_priority_needs_the_priority_policy():
    """The default scheduling_policy "fcfs" ignores priority: LLM.generate refuses a
    non-zero one before anything runs (vLLM's rule); "priority" takes it."""
    llm = LLM(max_model_len=128, scheduling_policy="fcfs")
    greedy = SamplingParams(temperature=0, max_tokens=1)
    with pytest.raises(ValueError, match="^Got priority 3 but Priority scheduling is not "):
        llm.generate(["a", "b"], greedy, priority=[0, 3], use_tqdm=False)
    (out,) = llm.generate(["a"], greedy, priority=[0], use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 1
    llm.input_processor.scheduling_policy = "priority"  # as scheduling_policy="priority" sets it
    (out,) = llm.generate(["a"], greedy, priority=[3], use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 1
