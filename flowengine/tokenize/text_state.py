"""A request's text on the frontend: detokenization followed by stop-string checks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from flowengine.sampling_params import SamplingParams
from flowengine.tokenize.detokenizer import IncrementalDetokenizer
from flowengine.tokenize.stop_checker import StopStringChecker

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class IncrementalTextState:
    """Token ids of one completion in, text deltas and the matched stop string out.

    Owns an `IncrementalDetokenizer` and, when the request has stop strings, a
    `StopStringChecker`. The Detokenizer actor keeps one per running completion; on a
    stop-string match it finishes the request ("stop", stop_reason = the string) and
    aborts it in the engine.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
    ) -> None:
        self.sampling_params = sampling_params
        self.detokenizer = IncrementalDetokenizer(
            tokenizer,
            prompt_token_ids,
            skip_special_tokens=sampling_params.skip_special_tokens,
            spaces_between_special_tokens=sampling_params.spaces_between_special_tokens,
        )
        stops = sampling_params.stop_strings
        self.stop_checker = (
            StopStringChecker(stops, sampling_params.include_stop_str_in_output) if stops else None
        )
        self._parts: list[str] = []
        # vLLM v1's rule: stop strings are checked only once the completion has more
        # than min_tokens tokens, and must end after the text of the first min_tokens
        # tokens (they may start within it).
        self._min_tokens = sampling_params.min_tokens
        self._num_tokens = 0

    @property
    def stop_reason(self) -> str | None:
        """The stop string that ended the text, or None."""
        return self.stop_checker.matched if self.stop_checker is not None else None

    @property
    def is_stopped(self) -> bool:
        return self.stop_reason is not None

    @property
    def output_text(self) -> str:
        """All text emitted so far (stop-truncated)."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def process(
        self, new_token_ids: list[int], finished: bool, *, stopped_by_token: bool = False
    ) -> tuple[str, str | None]:
        """Feed one step's new token ids; return (delta text, matched stop string or None).

        finished: the engine finished the request (EOS, stop id, length, abort): held
        back text is released. stopped_by_token: it finished on EOS or a stop token id
        that is the last of `new_token_ids`; that token's text is left out unless
        include_stop_str_in_output (vLLM v1's rule). After a stop-string match every
        call returns ("", None).
        """
        stop_checker = self.stop_checker
        if stop_checker is not None and stop_checker.matched is not None:
            return "", None
        ids = new_token_ids
        if stopped_by_token and ids and not self.sampling_params.include_stop_str_in_output:
            ids = ids[:-1]
        self._num_tokens += len(new_token_ids)
        delta = self.detokenizer.update(ids)
        if finished:
            delta += self.detokenizer.flush()
        matched = None
        if stop_checker is not None:  # no stop strings: no checker, nothing held back
            delta, matched = stop_checker.process(delta, self._num_tokens > self._min_tokens)
            if finished and matched is None:
                delta += stop_checker.flush()
        if delta:
            self._parts.append(delta)
        return delta, matched
