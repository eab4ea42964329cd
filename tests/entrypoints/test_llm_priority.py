"""LLM.generate's `priority` list: one entry per prompt, checked before any prompt."""

from __future__ import annotations

import pytest

from flowengine import LLM


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


def test_in_process_generate_raises_the_gc_threshold_while_it_steps():
    """The in-process `LLM` raises the collector's generation-0 threshold while its
    engine steps (as AsyncEngine does; gc_utils.raise_gen0_threshold) and restores it
    after, also when a step raises."""
    import gc

    from flowengine.config import EngineArgs
    from flowengine.engine.gc_utils import OBJECTS_PER_REQUEST_STEP

    class FakeCore:
        def __init__(self, fail: bool) -> None:
            self.fail, self.steps, self.seen = fail, 0, []

        def has_unfinished_requests(self) -> bool:
            return self.steps == 0

        def step(self):
            self.steps += 1
            self.seen.append(gc.get_threshold()[0])
            if self.fail:
                raise RuntimeError("step failed")
            return []

        def abort_requests(self, ids) -> None:
            pass

    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        for fail in (False, True):
            llm = LLM.__new__(LLM)
            llm._background, llm.tokenizer, llm._num_tokens = None, None, [0, 0]
            llm.engine_args = EngineArgs.from_kwargs(model="x", max_num_seqs=64,
                                                     disable_log_stats=True)
            llm.engine = FakeCore(fail)
            if fail:
                with pytest.raises(RuntimeError, match="step failed"):
                    llm._run([], use_tqdm=False)
            else:
                assert llm._run([], use_tqdm=False) == []
            assert llm.engine.seen[0] == OBJECTS_PER_REQUEST_STEP * 64
            assert gc.get_threshold() == (700, 10, 10)
    finally:
        gc.set_threshold(*before)
