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
